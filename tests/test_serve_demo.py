"""The README's main command: the server with no --model serves the shipped demo model, which
answers held-out task prompts correctly through the OpenAI API."""

from __future__ import annotations

import openai
from test_serve_openai import serve_subprocess

from sangam.demo.tasks import DEMO_FAMILIES, generate


def test_demo_model_answers_over_http(tmp_path):
    tasks = [t for i, f in enumerate(DEMO_FAMILIES) for t in generate(f, 1, seed=11 + i)]
    with serve_subprocess(["--device", "cpu"], tmp_path / "server.log") as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="dummy", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["sangam-demo"]
        for task in tasks:
            resp = client.chat.completions.create(
                model="sangam-demo", messages=[{"role": "user", "content": task.prompt}],
                extra_body={"threshold": 0.9, "cache": "dual"})
            assert resp.choices[0].message.content.strip() == task.answer, task
            assert resp.choices[0].finish_reason == "stop"
