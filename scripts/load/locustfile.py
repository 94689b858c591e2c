"""Locust users for ``scripts/load/run.py``: chat clients asking the demo model its tasks, half
of them streamed.

A 200 must carry a whole answer (a stream must end with [DONE] and no error event); a 503 counts
as expected when it is fast (within FAST_503_S, with Retry-After), and the client then waits as
Retry-After says, as OpenAI's client does; anything else is a failure.
Each outcome is its own row in locust's statistics ("chat 200", "chat 503").
"""

from __future__ import annotations

import os
import random

from locust import HttpUser, task

from sangam.demo.tasks import DEMO_FAMILIES, sample_task

FAST_503_S = float(os.environ.get("SANGAM_FAST_503_S", "0.5"))
MODEL = "sangam-demo"


class ChatClient(HttpUser):
    retry_after = 0.0  # set by a 503

    def wait_time(self) -> float:
        wait = max(self.retry_after, random.uniform(0.05, 0.2))  # a moment to "think"
        self.retry_after = 0.0
        return wait

    @task
    def ask(self) -> None:
        rng = random.Random()
        prompt = sample_task(rng.choice(DEMO_FAMILIES), rng).prompt
        stream = rng.random() < 0.5
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "stream": stream}
        with self.client.post("/v1/chat/completions", json=body, name="chat", stream=stream,
                              catch_response=True) as r:
            if r.status_code == 503:
                r.request_meta["name"] = "chat 503"
                if r.elapsed.total_seconds() <= FAST_503_S and r.headers.get("Retry-After"):
                    self.retry_after = float(r.headers["Retry-After"])
                    r.success()
                else:
                    r.failure(f"slow 503: {r.elapsed.total_seconds():.3f} s")
            elif r.status_code != 200:
                r.failure(f"unexpected status {r.status_code}: {r.text[:200]}")
            elif stream:
                r.request_meta["name"] = "chat 200"
                text = r.content.decode()
                if not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                    r.failure(f"a stream that did not end well: {text[-200:]}")
                else:
                    r.success()
            else:
                r.request_meta["name"] = "chat 200"
                choice = r.json()["choices"][0]
                if choice["finish_reason"] not in ("stop", "length"):
                    r.failure(f"finish_reason {choice['finish_reason']}")
                else:
                    r.success()

