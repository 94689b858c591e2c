"""The README's main command: the server with no --model serves the shipped demo model, which
answers held-out task prompts correctly through the OpenAI API and through ``sangam chat``;
and the ``sangam`` command's other subcommands."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import openai
import pytest
from test_serve_openai import REPO, serve_subprocess

from sangam.demo.tasks import DEMO_FAMILIES, generate
from sangam.demo.tokenizer import chat_prompt

TASKS = [t for i, f in enumerate(DEMO_FAMILIES) for t in generate(f, 1, seed=11 + i)]


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("demo") / "server.log"
    with serve_subprocess(["--device", "cpu"], log) as (_, base):
        yield base


def test_demo_model_answers_over_http(demo_server):
    client = openai.OpenAI(base_url=f"{demo_server}/v1", api_key="dummy", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["sangam-demo"]
    for task in TASKS:
        resp = client.chat.completions.create(
            model="sangam-demo", messages=[{"role": "user", "content": task.prompt}],
            extra_body={"threshold": 0.9, "cache": "dual"})
        assert resp.choices[0].message.content.strip() == task.answer, task
        assert resp.choices[0].finish_reason == "stop"


def _sangam(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sangam.cli", *args], input=stdin, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_sangam_chat_and_complete(demo_server):
    """vLLM's `vllm chat` / `vllm complete` as `sangam chat` / `sangam complete`: one message
    (-q), or a conversation read line by line; a server that is not there is a clear error."""
    url = f"{demo_server}/v1"
    first, second = TASKS[:2]
    quick = _sangam("chat", "--url", url, "-q", first.prompt)
    assert quick.returncode == 0 and quick.stdout.strip() == first.answer, quick
    talk = _sangam("chat", "--url", url, stdin=f"{first.prompt}\n\n{second.prompt}\n")
    assert talk.returncode == 0, talk
    assert talk.stdout.startswith("Using model sangam-demo.")
    replies = [r.strip() for r in talk.stdout.split("> ")[1:] if r.strip()]
    # The second turn carries the first: the reply is the API's to the whole conversation.
    history = [{"role": "user", "content": first.prompt},
               {"role": "assistant", "content": first.answer},
               {"role": "user", "content": second.prompt}]
    client = openai.OpenAI(base_url=url, api_key="dummy", max_retries=0)
    reply = client.chat.completions.create(model="sangam-demo", messages=history)
    assert replies == [first.answer, reply.choices[0].message.content.strip()]
    prompt = chat_prompt(first.prompt)  # the chat turn as raw text: a completion answers it
    done = _sangam("complete", "--url", url, "-q", prompt)
    ref = client.completions.create(model="sangam-demo", prompt=prompt)
    assert done.returncode == 0 and done.stdout == ref.choices[0].text + "\n", done
    assert first.answer in done.stdout
    bad = _sangam("chat", "--url", url, "--max-tokens", "0", "-q", "hi")
    assert bad.returncode == 1 and "max_tokens" in bad.stderr
    refused = _sangam("chat", "--url", url, "--max-tokens", "0", stdin="hi\nhello\n")
    assert refused.returncode == 0 and refused.stdout.count("error: HTTP 400") == 2, refused
    gone = _sangam("chat", "--url", "http://127.0.0.1:9/v1", "-q", "hi")
    assert gone.returncode == 1 and "cannot reach the server" in gone.stderr


def test_sangam_bench_is_sangam_bench(capsys):
    """`sangam bench ...` runs `sangam-bench ...`, as `vllm bench`."""
    from sangam.cli import main

    assert main(["bench", "host", "--batch-sizes", "1", "--iters", "3", "--rounds", "1",
                 "--impl", "python"]) == 0
    assert "outputs" in capsys.readouterr().out


def test_sangam_bench_host_stop_strings_and_long_responses(capsys):
    from sangam.cli import main

    args = ["bench", "host", "--batch-sizes", "2", "--rounds", "1", "--impl", "python",
            "--stop", "--gen-len", "64"]
    assert main([*args, "--iters", "40"]) == 0
    assert "outputs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="lower --iters"):  # 64 tokens end in ~64 iterations
        main([*args, "--iters", "500"])
