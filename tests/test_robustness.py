"""What must never take the server down or stall it, over HTTP: a single malformed or hostile
request (every number bounded, text that is not Unicode refused, token ids checked before
anything decodes them), a request that fails inside the engine (a 500 for it alone), big
bodies (413 beyond the limit; within it, tokenizing never holds up /health), overload (a fast
503), every route but /health and /metrics behind --api-key, and an engine loop that fails
(health fails and the process exits 1). Also what clients expect of an OpenAI-compatible
server: null as "unset", vLLM's /tokenizer_info, an honest 405."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from faults import POISON, patched
from test_cancellation import _metric
from test_serve_openai import MODEL, serve_in_thread, serve_subprocess

from sangam import LLM, SamplingParams
from sangam.engine.profiler import EngineProfiler
from sangam.models.transformer import DiffusionLM

KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_QUEUE_LEN = 4
SLOW = dict(model=MODEL, prompt="x", max_tokens=200, block_length=1, unmasking="topk",
            cache="none", stop_at_eos=False)


@pytest.fixture(scope="module")
def server(chat_ckpt, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("robust") / "server.log"
    traces = tmp_path_factory.mktemp("traces")
    args = ["--model", chat_ckpt, "--device", "cpu", "--served-model-name", MODEL,
            "--api-key", KEY, "--profiler-dir", str(traces), "--max-queue-len",
            str(MAX_QUEUE_LEN), "--log-level", "warning", "--block-length", "4"]
    with serve_subprocess(args, log) as (_, url):
        yield url


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


def _raw(http: httpx.Client, path: str, text: str) -> httpx.Response:
    """POST a JSON text as given (escapes such as lone surrogates stay in)."""
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def _alive(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]


HOSTILE = [  # (path, JSON text, fragment of the 400's message)
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "temperature": 1.0,
                                    "top_k": 2**63}), "top_k"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stop_token_ids": [2**63]}),
     "stop_token_ids"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "stop_token_ids": [500]}),
     "stop_token_ids: token ids must be in"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": {
        str(2**40): 1}}), "logit_bias"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [-1], "echo": True}), "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [10**6], "echo": True}),
     "token ids must be in"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "\ud800"}), "lone surrogate"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "hi \udc00"}]}), "messages.0.content"),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}), "lone surrogate"),
    ("/v1/responses", json.dumps({"model": MODEL, "input": "\udfff"}), "input"),
    ("/tokenize", json.dumps({"model": MODEL, "prompt": "\ud800\ud800"}), "lone surrogate"),
    ("/tokenize", json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "x", "name": "\ud800"}]}), "name"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi",
                                    "chat_template_kwargs": {"\ud800": 1}}), "(key)"),
]


@pytest.mark.parametrize("path,text,fragment", HOSTILE)
def test_no_single_request_can_harm_the_server(http, path, text, fragment):
    r = _raw(http, path, text)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    _alive(http)


def test_any_integer_is_a_seed(http):
    """As OpenAI's: a seed beyond the engine's 63 bits is taken modulo 2**63."""
    body = dict(model=MODEL, prompt="hi", max_tokens=8, temperature=1.5, stop_at_eos=False)
    small, big = (http.post("/v1/completions", json={**body, "seed": seed}).json()
                  for seed in (5, 2**63 + 5))
    assert small["choices"][0]["token_ids"] == big["choices"][0]["token_ids"]


def test_paired_surrogates_are_text(http):
    r = _raw(http, "/tokenize", json.dumps({"model": MODEL, "prompt": "ok \U0001F600"}))
    assert r.status_code == 200  # the escape \ud83d\ude00 is one character: an emoji


def test_bodies_beyond_the_limit_are_refused(http):
    big = json.dumps({"model": MODEL, "prompt": "a" * (2 * 2**20)})
    r = _raw(http, "/tokenize", big)
    assert r.status_code == 413 and "max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: refused once the body passes the limit
        for _ in range(40):
            yield b" " * 2**16

    r = http.post("/tokenize", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    _alive(http)


def test_health_answers_promptly_while_big_prompts_are_tokenized(server, http):
    """Four clients send the biggest bodies allowed, to /tokenize, while long generations
    run: /health keeps answering (the tokenizer and the JSON work are off the event loop)."""
    near_limit = "ab" * (2**20 - 64)
    stop = threading.Event()
    latencies = []

    def probe():
        with httpx.Client(base_url=server, timeout=30) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    async def load():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as client:
            work = [client.post("/tokenize", json={"model": MODEL, "prompt": near_limit})
                    for _ in range(4)]
            work += [client.post("/v1/completions", json={**SLOW, "max_tokens": 60})
                     for _ in range(2)]
            return await asyncio.gather(*work)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        start = time.monotonic()
        responses = asyncio.run(load())
        busy = time.monotonic() - start
    finally:
        stop.set()
        prober.join()
    assert [r.status_code for r in responses] == [200] * 6
    assert responses[0].json()["count"] == len(near_limit)
    # Generous bounds for a shared CI machine; the README's load run measures it.
    assert busy > 2.0 and len(latencies) > 20
    assert statistics.median(latencies) < 0.1 and max(latencies) < 1.0, sorted(latencies)[-5:]


def test_overload_is_a_fast_503(server, http):
    """With the queue full, new requests are refused at once, before any tokenizing."""
    async def main():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=300) as client:
            # Long enough to outlast the refusals even on a slow machine.
            hold = [asyncio.create_task(client.post("/v1/completions",
                                                    json={**SLOW, "max_tokens": 400}))
                    for _ in range(MAX_QUEUE_LEN)]
            deadline = time.monotonic() + 60
            while _metric((await client.get("/metrics")).text,
                          "sangam_requests_in_flight") < MAX_QUEUE_LEN:  # all admitted
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)

            async def refused():
                start = time.monotonic()
                r = await client.post("/v1/completions", json={**SLOW, "prompt": "y" * 5000})
                return r, time.monotonic() - start

            tried = await asyncio.gather(*(refused() for _ in range(100)))
            return tried, await asyncio.gather(*hold)

    tried, held = asyncio.run(main())
    assert all(r.status_code == 200 for r in held)
    assert all(r.status_code == 503 and r.headers["Retry-After"] for r, _ in tried), [
        r.status_code for r, _ in tried]
    waits = sorted(s for _, s in tried)
    assert waits[len(waits) // 2] < 0.5, waits


def test_every_route_but_health_and_metrics_needs_the_key(server):
    open_routes = [("GET", "/health"), ("GET", "/metrics")]
    keyed = [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
             ("POST", "/start_profile"), ("POST", "/stop_profile"), ("GET", "/version"),
             ("GET", "/openapi.json"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
             ("GET", "/no/such/route")]
    for method, path in open_routes:
        assert httpx.request(method, server + path).status_code == 200, path
    for method, path in keyed:
        r = httpx.request(method, server + path, json={})
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_profiler_traces_are_bounded(tmp_path, monkeypatch):
    """A profile stops by itself after MAX_PROFILED_STEPS iterations; a directory keeps the
    newest MAX_TRACES traces."""
    monkeypatch.setattr("sangam.engine.profiler.MAX_PROFILED_STEPS", 3)
    monkeypatch.setattr("sangam.engine.profiler.MAX_TRACES", 2)
    profiler = EngineProfiler(tmp_path)
    written = []
    for _ in range(4):
        profiler.start()
        assert [profiler.step() for _ in range(3)][:2] == [None, None]
        assert not profiler.active  # stopped at the cap, its trace written
        written.append(profiler.stop())  # which stop returns
    assert sorted(tmp_path.iterdir()) == sorted(written[-2:])


def test_null_is_unset(http):
    """OpenAI's clients and vLLM's send null for fields they leave unset."""
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": None, "stop": None,
        "stream_options": {"include_usage": None}, "temperature": None, "n": None})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi", "name": None}],
        "max_tokens": 4, "parallel_tool_calls": None, "tools": None, "stream": None})
    assert r.status_code == 200, r.text
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": None}}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": None})
    assert r.status_code == 400  # a required field stays required


def test_tokenizer_info_as_vllm(http):
    """lm-eval's remote tokenizer reads /tokenizer_info (eos/bos/pad tokens, the chat
    template), then /tokenize and /detokenize."""
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|endoftext|>"
    assert info["bos_token"] == "<|startoftext|>" and "pad_token" in info
    assert "{% for message in messages %}" in info["chat_template"]
    eos = http.post("/tokenize", json={"prompt": info["eos_token"],
                                       "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1
    assert http.post("/detokenize", json={"tokens": eos}).json()["prompt"] == info["eos_token"]


def test_405_names_every_method_of_the_path(http):
    r = http.put("/v1/responses/resp_1")
    assert r.status_code == 405 and r.headers["Allow"] == "DELETE, GET"
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.headers["Allow"] == "POST"


def test_openapi_schema_says_what_the_server_does(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    for path, operations in paths.items():
        for method, op in operations.items():
            assert "422" not in op["responses"], (method, path)
            if path not in ("/health", "/metrics"):
                assert "401" in op["responses"] and op["security"], (method, path)
    completions = paths["/v1/completions"]["post"]
    assert {"200", "400", "404", "413", "500", "503"} <= set(completions["responses"])
    assert set(completions["responses"]["200"]["content"]) == {"application/json",
                                                               "text/event-stream"}
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    body = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert body["top_k"]["anyOf"][0]["maximum"] == 2**31 - 1
    assert {"type": "null"} in body["stream"]["anyOf"]  # null accepted, as the server does


def _accepts(schema: dict, field: str, value: object) -> bool:
    """Whether ``value`` of a request body's ``field`` validates against the served schema."""
    document = {"$ref": "#/components/schemas/X", "components": {"schemas": {
        **schema["components"]["schemas"],
        "X": {"type": "object", "properties": {
            field: schema["components"]["schemas"][_body_of(field)]["properties"][field]}}}}}
    try:
        jsonschema.validate({field: value}, document)
    except jsonschema.ValidationError:
        return False
    return True


def _body_of(field: str) -> str:
    return {"best_of": "CompletionRequest", "response_format": "ChatCompletionRequest",
            "n": "ResponsesRequest", "previous_response_id": "ResponsesRequest"}[field]


@pytest.mark.parametrize("field, value, served", [
    ("best_of", 1, True), ("best_of", None, True), ("best_of", 3, False),
    ("n", 1, True), ("n", 2, False),  # the Responses API's
    ("response_format", {"type": "json_object"}, True), ("response_format", {}, False),
    ("previous_response_id", None, True),
    ("previous_response_id", "resp_1", False),  # no --responses-store-size here
])
def test_openapi_schema_allows_only_what_is_served(http, field, value, served):
    """A value the server always refuses is not schema-valid (issue #36's schema defects)."""
    assert _accepts(http.get("/openapi.json").json(), field, value) == served


def test_a_request_that_fails_in_the_engine_ends_alone(chat_ckpt, monkeypatch):
    """Its forward raises: its client gets a 500 that says so (streamed too, since it fails
    before its first block),
    requests batched with it get their tokens, the engine goes on, /metrics counts it."""
    monkeypatch.setattr(DiffusionLM, "hidden_states",
                        patched(DiffusionLM.hidden_states, poison=True))
    poisoned = POISON + [10, 11]
    llm = LLM(chat_ckpt, device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False)
    prompts = [[20 + i, 30, 40] for i in range(6)]
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    body = dict(model=MODEL, max_tokens=8, block_length=4, stop_at_eos=False)
    with serve_in_thread(chat_ckpt) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                good = [client.post("/v1/completions", json={**body, "prompt": p})
                        for p in prompts]
                bad = client.post("/v1/completions", json={**body, "prompt": poisoned})
                streamed = client.post("/v1/completions", json={
                    **body, "prompt": poisoned, "stream": True})
                return await asyncio.gather(bad, streamed, *good)

        bad, streamed, *good = asyncio.run(main())
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
        assert "poisoned request" in bad.json()["error"]["message"]
        # It fails at its first forward, before a first block: no stream has begun.
        assert streamed.status_code == 500 and "poisoned request" in streamed.text
        assert [r.json()["choices"][0]["token_ids"] for r in good] == want
        metrics = httpx.get(f"{url}/metrics").text
        assert 'sangam_requests_finished_total{finish_reason="error"} 2.0' in metrics
        assert 'sangam_kv_pool_pages_used 0.0' in metrics


def test_requests_that_all_fail_alone_end_alone(chat_ckpt, monkeypatch):
    """A batch of nothing but failing requests (two hostile clients at once) ends each with its
    error; the engine goes on to serve the next request."""
    monkeypatch.setattr(DiffusionLM, "hidden_states",
                        patched(DiffusionLM.hidden_states, poison=True))
    llm = LLM(chat_ckpt, device="cpu", dtype="float64")
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False)
    outs = llm.generate(prompt_token_ids=[POISON + [10], POISON + [11]], sampling_params=params)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("poisoned request" in o.error for o in outs)
    good = llm.generate(prompt_token_ids=[[20, 30, 40]], sampling_params=params)
    assert good[0].finish_reason == "length" and len(good[0].token_ids) == 8


_DYING_SERVER = """
import sys
from sangam.engine.engine import Engine
def step(self):
    raise RuntimeError("the engine loop broke (test fault)")
Engine.step = step
from sangam.serve.server import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_failed_engine_loop_fails_health_and_exits_nonzero(chat_ckpt, tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(_DYING_SERVER)
    log = tmp_path / "server.log"
    with serve_subprocess(["--model", chat_ckpt, "--device", "cpu", "--log-level", "info"],
                          log, entry=(str(script),)) as (proc, url):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 503 and "the engine loop failed" in r.json()["error"]["message"]
        assert proc.wait(timeout=30) == 1
    text = log.read_text()
    assert "Traceback" in text and "the engine loop broke (test fault)" in text
    assert "exiting: the engine loop failed" in text



def test_the_heap_trimmer_trims_at_its_interval(monkeypatch):
    from sangam.engine import heap

    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: calls.append)
    clock = [100.0]
    trimmer = heap.HeapTrimmer(30.0, lambda: clock[0])
    trimmer.maybe_trim()
    clock[0] += 29.0
    trimmer.maybe_trim()
    assert calls == []
    clock[0] += 2.0
    trimmer.maybe_trim()
    trimmer.maybe_trim()
    assert calls == [0] and trimmer.trims == 1
    assert heap._malloc_trim() is not None  # this machine's C library is glibc
