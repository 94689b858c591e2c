"""The server's failure modes: every client error is an OpenAI-style JSON error with the right
status (never a 5xx), overload is a 503 with Retry-After, a client that leaves frees its KV
pages, --api-key guards /v1, and SIGTERM exits 0. The last test stops the module's server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_serve_openai import serve_subprocess

from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.testing import make_tiny_checkpoint

MODEL = "tiny"
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512  # the model's context
POOL_TOKENS = 16 * 16  # --num-pages 16 --page-size 16: smaller than the context
MAX_QUEUE_LEN = 3
# Runs ~240 forwards: long enough to be caught in flight.
SLOW = dict(prompt="x", max_tokens=POOL_TOKENS - 16, block_length=1, unmasking="topk",
            cache="none", stop_at_eos=False)
MEDIUM = {**SLOW, "max_tokens": 96}  # two fit the pool at once


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, str]]:
    """``sangam serve CKPT`` (the console entry point, model given positionally as with
    ``vllm serve``) on a tiny checkpoint with a tokenizer."""
    ckpt = tmp_path_factory.mktemp("llada_small")
    make_tiny_checkpoint(ckpt, arch="llada", seed=4, vocab_size=VOCAB_SIZE,
                         max_position=CONTEXT)
    write_tokenizer(ckpt)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    args = [str(ckpt), "--device", "cpu", "--api-key", KEY,
            "--served-model-name", MODEL, "--num-pages", "16", "--page-size", "16",
            "--max-queue-len", str(MAX_QUEUE_LEN), "--block-length", "4",
            "--max-tokens-default", "8", "--shutdown-grace", "2", "--log-level", "warning"]
    with serve_subprocess(args, log, entry=("-m", "sangam.cli", "serve")) as server:
        yield server


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[1], headers=AUTH, timeout=60) as client:
        yield client


def _metrics(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {name: float(v) for name, v in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def _wait_idle(http: httpx.Client, timeout: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing is in flight and every KV page is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        if m["sangam_requests_in_flight"] == 0 and m["sangam_kv_pool_pages_used"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy: {m}"
        time.sleep(0.1)


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CMPL, CHAT, RESP = "/v1/completions", "/v1/chat/completions", "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
BAD_REQUESTS = [
    # (endpoint, body: dict or raw bytes, status, fragment of the message)
    (CMPL, b'{"prompt": "hi",', 400, "malformed JSON"),
    (CMPL, b"not json at all", 400, "malformed JSON"),
    (CMPL, b"[1, 2, 3]", 400, ""),
    (CMPL, b"", 400, ""),
    (CMPL, {"max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": 12}, 400, "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": 4.5}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    (CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    (CMPL, {"prompt": "hi", "temperature": 1e300}, 400, "temperature"),
    (CMPL, {"prompt": ""}, 400, "at least 1 character"),
    (CMPL, {"prompt": []}, 400, "at least 1 item"),
    (CMPL, {"prompt": [[1, 2], []]}, 400, "prompt.1: list should have at least 1 item"),
    (CMPL, {"prompt": [1, True]}, 400, "prompt"),
    (CMPL, {"prompt": [5, VOCAB_SIZE + 3]}, 400, "token ids"),
    (CMPL, {"prompt": "y" * (CONTEXT + 10)}, 400, "context"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    (CMPL, {"prompt": "hi", "max_tokens": CONTEXT}, 400, "context"),
    (CMPL, {"prompt": "hi", "max_tokens": 10**30}, 400, "less than or equal to 2147483647"),
    (CMPL, {"prompt": "hi", "max_tokens": POOL_TOKENS + 32}, 400, "KV pages"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "hi", "n": 129}, 400, "n"),
    (CMPL, {"prompt": ["a", "b"], "n": MAX_QUEUE_LEN // 2 + 1}, 400, "max-queue-len"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, "unsupported"),
    (CMPL, {"prompt": "hi", "echo": True, "logprobs": 0}, 400, "echo"),
    (CMPL, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stop": [7]}, 400, "stop"),
    (CMPL, {"prompt": "hi", "stop": "x" * 2000}, 400, "at most"),
    (CMPL, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "ignore_eos": True, "stop_at_eos": True}, 400, "contradict"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    (CMPL, {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    (CMPL, {"prompt": "hi", "priority": 1.5}, 400, "priority"),
    (CMPL, {"prompt": "hi", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    (CMPL, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CMPL, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CMPL, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (CMPL, {"prompt": "hi", "unmasking": "random"}, 400, "unmasking"),
    (CMPL, {"prompt": "hi", "threshold": 1.5}, 400, "threshold"),
    (CMPL, {"prompt": "hi", "factor": 0}, 400, "factor"),
    (CMPL, {"prompt": "hi", "tokens_per_step": 0}, 400, "tokens_per_step"),
    (CMPL, {"prompt": "hi", "block_length": 0}, 400, "block_length"),
    (CMPL, {"prompt": "hi", "block_length": 10**6}, 400, "context"),
    (CMPL, {"prompt": "hi", "cache": "full"}, 400, "cache"),
    (CMPL, {"prompt": "hi", "refresh_interval": 0}, 400, "refresh_interval"),
    (CMPL, {"prompt": "hi", "prompt_refresh_interval": 2**31}, 400, "prompt_refresh_interval"),
    (CMPL, {"prompt": "hi", "cache": "none", "refresh_interval": 2}, 400, "need a cache"),
    (CMPL, {"prompt": "hi", "refresh_confidence": 1.5}, 400, "refresh_confidence"),
    (CMPL, {"prompt": "hi", "threshold": 0.5, "min_threshold": 0.7}, 400, "min_threshold"),
    (CMPL, {"prompt": "hi", "seed": -1}, 400, "seed"),
    (CMPL, {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    (CMPL, b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, "malformed JSON"),
    # Nesting deeper than the parser recurses (and than validation would): a 400, not a 500.
    (CMPL, b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nests"),
    (CMPL, b'{"prompt": "hi", "x": ' + b"[" * 990 + b"]" * 990 + b"}", 400, "nests"),
    (CHAT, b'{"messages": [{"role": "user", "content": ' + b"[" * 990 + b"]" * 990 + b"}]}",
     400, "nests"),
    (CMPL, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (CMPL, {"prompt": "hi", "stop_at_eos": "no"}, 400, "stop_at_eos"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ""),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": -1}, 400, "logprobs"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    (CHAT, {"messages": USER, "tools": TOOLS}, 400, "--enable-auto-tool-choice"),
    (CHAT, {"messages": USER, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    (CHAT, {"messages": USER, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among"),
    (CHAT, {"messages": USER, "tool_choice": "auto"}, 400, "needs tools"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "needs tools"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, 400, "does not compile"),
    (CHAT, {"messages": USER, "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "at most one output constraint"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (RESP, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}, 400,
     "--enable-auto-tool-choice"),
    (RESP, {"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    (RESP, {"input": [{"type": "shell_call"}]}, 400, "expected tags"),
    (RESP, {"input": []}, 400, "at least 1 item"),
    (RESP, {"input": "z" * CONTEXT}, 400, "context"),
    (RESP, {"input": "hi", "model": "gpt-4"}, 404, "does not exist"),
    (CHAT, {"messages": [{"role": "user", "content": "z" * CONTEXT}]}, 400, "context"),
]


def _post(http: httpx.Client, path: str, body: dict | bytes, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"}, **kw)
    return http.post(path, json=body, **kw)


@pytest.mark.parametrize("path,body,status,fragment", BAD_REQUESTS)
def test_bad_request(http, path, body, status, fragment):
    err = _assert_error(_post(http, path, body), status)
    assert fragment.lower() in err["message"].lower()
    assert err["type"] == "invalid_request_error"


def test_unknown_route_and_method(http):
    _assert_error(http.get("/v1/nothing"), 404)
    _assert_error(http.get(CMPL), 405)
    # The RL-rollout routes are served only with --enable-rollout-routes.
    _assert_error(http.post("/update_weights_from_disk", json={"model_path": "/"}), 404)


def test_api_key(server):
    base = server[1]
    _assert_error(httpx.get(f"{base}/v1/models"), 401)
    _assert_error(httpx.post(f"{base}{CMPL}", json={"prompt": "hi"}), 401)
    _assert_error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}),
                  401)
    _assert_error(httpx.post(f"{base}{CMPL}", content=b"{bad json"), 401)  # auth comes first
    assert httpx.get(f"{base}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # open, as in vLLM
    assert httpx.get(f"{base}/metrics").status_code == 200


def _stream_tokens(http: httpx.Client, body: dict) -> tuple[list[int], list[str | None]]:
    tokens, reasons = [], []
    with http.stream("POST", CMPL, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice["token_ids"]
                reasons.append(choice["finish_reason"])
    return tokens, reasons


def test_bad_requests_do_not_disturb_others(http):
    body = dict(prompt="steady", max_tokens=60, block_length=2, seed=9, temperature=1.0,
                stop_at_eos=False)
    alone, _ = _stream_tokens(http, body)

    async def barrage():
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=AUTH,
                                     timeout=60) as ac:
            main = asyncio.create_task(asyncio.to_thread(_stream_tokens, http, body))
            for path, bad, status, _ in BAD_REQUESTS * 2:
                kw = dict(content=bad, headers={"Content-Type": "application/json"}) if (
                    isinstance(bad, bytes)) else dict(json=bad)
                assert (await ac.post(path, **kw)).status_code == status
            return await main

    tokens, reasons = asyncio.run(barrage())
    assert tokens == alone and len(tokens) == 60
    assert reasons[-1] == "length"
    _wait_idle(http)


def test_overload_is_503_with_retry_after(http):
    async def burst():
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=AUTH,
                                     timeout=120) as ac:
            return await asyncio.gather(*(ac.post(CMPL, json=MEDIUM) for _ in range(8)))

    before = _metrics(http)
    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= MAX_QUEUE_LEN - 1
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["Retry-After"]) >= 1
            assert _assert_error(r, 503)["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == MEDIUM["max_tokens"]
    after = _wait_idle(http)
    rejected = after.get('sangam_requests_rejected_total{reason="queue_full"}', 0) - before.get(
        'sangam_requests_rejected_total{reason="queue_full"}', 0)
    assert rejected == statuses.count(503)


@pytest.mark.parametrize("drafts", [False, True])
def test_disconnect_mid_stream_frees_pages(http, drafts):
    before = _metrics(http)
    # Blocks of 4: the 3 steps before each block's last send drafts.
    body = {**SLOW, "stream": True, "stream_options": {"include_drafts": drafts},
            **({"block_length": 4} if drafts else {})}
    with http.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        # With drafts, closed while they stream.
        assert next(line for line in lines if line.startswith("data: ") and (
            not drafts or '"draft_token_ids":[' in line))
        assert _metrics(http)["sangam_kv_pool_pages_used"] > 0
    # Leaving the block closes the connection mid-stream.
    after = _wait_idle(http)
    assert after["sangam_requests_aborted_total"] == before["sangam_requests_aborted_total"] + 1
    assert sum(v for k, v in after.items() if k.startswith("sangam_requests_finished_total")) \
        == sum(v for k, v in before.items() if k.startswith("sangam_requests_finished_total"))


def test_disconnect_while_waiting_frees_pages(http):
    before = _metrics(http)
    with pytest.raises(httpx.ReadTimeout):
        http.post(CMPL, json=SLOW, timeout=0.2)  # non-streaming: the client gives up early
    after = _wait_idle(http)
    assert after["sangam_requests_aborted_total"] == before["sangam_requests_aborted_total"] + 1


# Fuzzing: any JSON (or not) in any field must give a non-5xx answer and leave the server well.
_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
            | st.text(max_size=6))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6)


_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                  "content": st.text(max_size=12)})
_valid = {  # plausible values for every field; the fuzz then spoils some of them
    "prompt": st.text(min_size=1, max_size=12) | st.lists(
        st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6),
    "messages": st.lists(_message, min_size=1, max_size=3),
    "input": st.text(max_size=12) | st.lists(_message, max_size=3),
}
_optional = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 12),
    "temperature": st.floats(0, 3),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 8),
    "min_p": st.floats(-0.1, 1.1),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "truncate_prompt_tokens": st.integers(-2, 4),
    "priority": st.integers(-3, 3),
    "echo": st.booleans(),
    "suffix": st.text(max_size=3),
    "continue_final_message": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": (
        st.fixed_dictionaries({"name": st.text(max_size=3)}, optional={"parameters": _json}))}),
        max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "request_id": st.text(max_size=4),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["mark", "tokenize", "tools", "x y", "messages"]), _json, max_size=2),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "7", str(VOCAB_SIZE), "x"]),
                                  st.floats(-120, 120), max_size=2),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0, 3),
    "min_tokens": st.integers(0, 14),
    "logprobs": st.integers(-1, 21) | st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "seed": st.integers(0, 2**63 - 1),
    "block_length": st.integers(1, 8),
    "unmasking": st.sampled_from(["threshold", "factor", "topk"]),
    "threshold": st.floats(0, 1),
    "factor": st.floats(0.01, 4),
    "tokens_per_step": st.integers(1, 4),
    "cache": st.sampled_from(["dual", "prefix", "none"]),
    "refresh_interval": st.integers(0, 3),
    "prompt_refresh_interval": st.integers(0, 3),
    "refresh_confidence": st.floats(-0.5, 1.5),
    "min_threshold": st.floats(-0.5, 1.5),
    "stop_at_eos": st.booleans(),
    "ignore_eos": st.booleans(),
    "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2),
                                                       max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 3),
    "tokens": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=6),  # /detokenize
}
_names = sorted({*_valid, *_optional, "echo", "best_of", "stop", "suffix",
                  "add_special_tokens"})
# A plausible body, then 0-3 fields (known or not) replaced by arbitrary JSON.
_bodies = st.tuples(
    st.fixed_dictionaries(_valid, optional=_optional),
    st.dictionaries(st.sampled_from(_names) | st.text(max_size=8), _json, max_size=3),
).map(lambda t: json.dumps({**t[0], **t[1]}).encode())
_payloads = _bodies | _bodies | _bodies | _json.map(lambda v: json.dumps(v).encode()) \
    | st.binary(max_size=30)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from([CMPL, CHAT, RESP, "/tokenize", "/detokenize"]),
       payload=_payloads)
def test_fuzz_never_5xx(http, path, payload):
    r = _post(http, path, payload)
    event(f"status {r.status_code}")  # the mix shows with --hypothesis-show-statistics
    assert r.status_code < 500, (payload, r.status_code, r.text)
    if r.status_code != 200:
        _assert_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        if path == RESP:  # the Responses API ends with its response's last event, no [DONE]
            last = json.loads(r.text.rstrip().rsplit("data: ", 1)[1])
            assert last["type"] in ("response.completed", "response.incomplete"), r.text
        else:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
    elif path in (CMPL, CHAT):
        assert r.json()["choices"]
    elif path == RESP:
        assert r.json()["output"]


def test_healthy_after_everything(http):
    assert http.get("/health").json() == {"status": "ok"}
    m = _wait_idle(http)
    assert m["sangam_kv_pool_pages_used"] == 0
    assert m["sangam_requests_waiting"] == 0 and m["sangam_requests_seated"] == 0
    r = http.post(CMPL, json={"prompt": "still fine", "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) <= 4


def test_sigterm_exits_zero(server, http):
    """Must stay the last test: it stops the module's server."""
    proc, _ = server
    lines = []
    with http.stream("POST", CMPL, json={**SLOW, "stream": True}) as r:
        it = r.iter_lines()
        lines.append(next(line for line in it if line.startswith("data: ")))
        proc.send_signal(signal.SIGTERM)
        lines += [line for line in it if line]
    assert lines[-1] == "data: [DONE]"  # finished, or aborted after the grace: a whole stream
    last = json.loads(lines[-2][6:])["choices"][0]
    assert last["finish_reason"] in ("length", "abort")
    assert proc.wait(timeout=60) == 0
