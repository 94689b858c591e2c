"""Cancellation as a property: hundreds of requests, each left by its caller at a random moment
of its life (before the engine thread accepts it, right after admission, mid-block, at a block
boundary, while its K/V is in transfer, mid-stream), or aborted, or run to the end, all at once;
in one process, on workers, and over HTTP. Afterwards the engine is alive, every request that
ran to the end has its reference tokens, every KV page is free again, and ``/metrics`` counts
each abort."""

from __future__ import annotations

import asyncio
import random
import re
import time

import httpx
import pytest
from test_serve_openai import MODEL, serve_in_thread

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.validation import new_state

# How a caller leaves: it does not (reads to the end), its task is cancelled (at a random
# moment: before the engine saw the request, queued, mid-block, at a boundary...), it closes
# its generator after some outputs, or it calls abort.
PLANS = ("finish", "cancel", "close", "abort")


def _workload(n: int, seed: int) -> list[tuple[str, list[int], SamplingParams, str, float]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 100) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_tokens=rng.choice([4, 8, 16]), block_length=4,
                                cache=rng.choice(["dual", "prefix", "none"]), seed=i,
                                temperature=rng.choice([0.0, 1.5]), stop_at_eos=False)
        out.append((f"r{i}", prompt, params, rng.choice(PLANS), rng.random()))
    return out


def _reference(path: str, reqs) -> dict[str, list[int]]:
    lm = LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))
    out = {}
    for rid, prompt, params, plan, _ in reqs:
        if plan == "finish":
            st = new_state(lm, prompt, params, random.Random(0))
            ReferenceDecoder(lm.model).run(st)
            out[rid] = st.output_token_ids()
    return out


async def _drive(engine: AsyncEngine, reqs, horizon: float) -> dict[str, object]:
    """Run every request at once, each left as its plan says at ``u**3 * horizon`` seconds;
    returns each one's last output (or the exception that ended its task)."""
    loop = asyncio.get_running_loop()

    async def one(rid, prompt, params, plan, u):
        last = None
        async with asyncio.timeout(120):
            gen = engine.generate(prompt, params, rid)
            try:
                async for out in gen:
                    last = out
                    if plan == "close" and not out.finished and u < 0.5:
                        return "closed"  # leaving the loop closes the generator: an abort
            finally:
                await gen.aclose()
        return last

    tasks = []
    for rid, prompt, params, plan, u in reqs:
        task = asyncio.create_task(one(rid, prompt, params, plan, u))
        # u**3: many moments are early, while the engine thread has yet to see the request.
        if plan == "cancel":
            loop.call_later(u**3 * horizon, task.cancel)
        elif plan == "abort":
            loop.call_later(u**3 * horizon,
                            lambda r=rid: asyncio.ensure_future(engine.abort(r)))
        tasks.append(task)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    return {r[0]: res for r, res in zip(reqs, results)}


def _check(results, reqs, want) -> None:
    for rid, _, _, plan, _ in reqs:
        res = results[rid]
        if plan == "finish":
            assert res.finished and res.finish_reason == "length", (rid, res)
            assert res.token_ids == want[rid], rid
        else:  # cut short, or finished before its moment came: never anything else
            assert (isinstance(res, asyncio.CancelledError) or res in ("closed", None)
                    or res.finish_reason in ("abort", "length")), (rid, plan, res)


def _wait_drained(engine: AsyncEngine, timeout: float = 60) -> None:
    """Until the engine holds no request and every page (on every live worker) is free."""
    deadline = time.monotonic() + timeout
    while True:
        e = engine.engine
        if isinstance(e, Engine):
            free = e.pool.allocator.num_free == e.pool.num_pages
        else:
            e.step()  # the front takes in its workers' reports when stepped
            free = all(s.free_pages == s.num_pages and s.open_transfers == 0
                       for s in e.worker_states() if s.alive)
        if free and not e.requests and engine.open_requests == 0:
            return
        assert time.monotonic() < deadline, "the engine did not drain"
        time.sleep(0.05)


def test_cancellation_at_any_moment_in_one_process(llada_path):
    reqs = _workload(240, seed=11)
    want = _reference(llada_path, reqs)
    engine = AsyncEngine(EngineConfig(model=llada_path, device="cpu", dtype="float64",
                                      page_size=4, num_pages=400))
    try:
        results = asyncio.run(_drive(engine, reqs, horizon=0.6))
        _check(results, reqs, want)
        assert engine.dead is None
        _wait_drained(engine)
        again = asyncio.run(_drive(engine, [(r, p, s, "finish", 0) for r, p, s, *_ in reqs[:4]],
                                   0))  # still serving, the same tokens
        assert all(again[r[0]].finished for r in reqs[:4])
    finally:
        engine.shutdown()


def test_callers_that_leave_before_the_engine_sees_their_request(llada_path, monkeypatch):
    """The moment a proxy's timeout hits under load: the engine thread is in a step while
    requests are submitted, and their callers cancel before it reads them."""
    engine = AsyncEngine(EngineConfig(model=llada_path, device="cpu", dtype="float64",
                                      page_size=4, num_pages=200))
    step = engine.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(engine.engine, "step", slow_step)
    params = SamplingParams(max_tokens=16, block_length=4, stop_at_eos=False)

    async def main():
        async def run(rid):
            return [o async for o in engine.generate([5, 6], params, rid)][-1]

        busy = asyncio.create_task(run("busy"))
        await asyncio.sleep(0.1)  # the engine thread is stepping it
        leavers = [asyncio.create_task(run(f"l{i}")) for i in range(50)]
        await asyncio.sleep(0.01)  # submitted, waiting to be accepted
        for task in leavers:
            task.cancel()
        await asyncio.gather(*leavers, return_exceptions=True)
        return await busy

    try:
        assert asyncio.run(main()).finish_reason == "length"
        assert engine.dead is None
        _wait_drained(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_cancellation_at_any_moment_on_workers(dream_path):
    """Hybrid 2P1D: refreshes run on prefill workers and overflow onto the decode worker, so
    requests are cut while queued at the front, refreshing, with K/V in flight, decoding."""
    reqs = _workload(48, seed=12)
    want = _reference(dream_path, reqs)
    engine = AsyncEngine(EngineConfig(model=dream_path, device="cpu", dtype="float64",
                                      page_size=4, num_pages=120, mode="hybrid",
                                      prefill_workers=2, decode_workers=1,
                                      overflow_threshold=30))
    try:
        results = asyncio.run(_drive(engine, reqs, horizon=3.0))
        _check(results, reqs, want)
        assert engine.dead is None and engine.engine.dead_workers == []
        _wait_drained(engine)
        assert engine.engine.counters.kv_transfers > 0
    finally:
        engine.shutdown()


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_cancellation_over_http(chat_ckpt):
    """Clients that disconnect mid-stream or time out while their request waits or runs, among
    clients that read to the end: the server counts each abort, frees every page and gives the
    others their tokens."""
    rng = random.Random(5)
    short = dict(model=MODEL, max_tokens=8, block_length=4, stop_at_eos=False)
    # Cut requests run for hundreds of forwards: cut, they cannot have finished.
    long = dict(model=MODEL, max_tokens=240, block_length=1, unmasking="topk",
                cache="none", stop_at_eos=False)
    plans = [rng.choice(["finish", "stream_cut", "timeout"]) for _ in range(150)]
    prompts = [f"p{i % 37}" for i in range(len(plans))]
    llm = LLM(chat_ckpt, device="cpu", dtype="float64")
    expected = {p: o.token_ids for p, o in zip(prompts, llm.generate(
        prompts, SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False)))}

    async def one(client, plan, prompt):
        if plan == "finish":
            r = await client.post("/v1/completions", json={**short, "prompt": prompt},
                                  timeout=120)
            return r.json()["choices"][0]["token_ids"]
        if plan == "timeout":  # the client gives up while queued or running
            try:  # (a read timeout: the request has reached the server, which counts it)
                await client.post("/v1/completions", json={**long, "prompt": prompt},
                                  timeout=httpx.Timeout(60, read=1.0 + rng.random()))
            except httpx.TimeoutException:
                return "cut"
            raise AssertionError("a long request finished before its client's timeout")
        async with client.stream("POST", "/v1/completions", timeout=120, json={
                **long, "prompt": prompt, "stream": True}) as r:
            async for line in r.aiter_lines():  # leaves after a few chunks
                if line.startswith("data: ") and rng.random() < 0.3:
                    return "cut"
        raise AssertionError("a long stream ended before its client left")

    with serve_in_thread(chat_ckpt) as url:
        before = httpx.get(f"{url}/metrics").text

        async def main():
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=url, limits=limits) as client:
                return await asyncio.gather(*(one(client, p, q)
                                              for p, q in zip(plans, prompts)))

        results = asyncio.run(main())
        for plan, prompt, res in zip(plans, prompts, results):
            assert res == ("cut" if plan != "finish" else expected[prompt])
        deadline = time.monotonic() + 60
        while True:  # the server notices each disconnect soon after it happens
            after = httpx.get(f"{url}/metrics").text
            if (_metric(after, "sangam_requests_in_flight") == 0
                    and _metric(after, "sangam_kv_pool_pages_used") == 0):
                break
            assert time.monotonic() < deadline, "requests or pages were left behind"
            time.sleep(0.1)
        aborted = (_metric(after, "sangam_requests_aborted_total")
                   - _metric(before, "sangam_requests_aborted_total"))
        assert aborted == sum(p != "finish" for p in plans)
        assert httpx.get(f"{url}/health").status_code == 200
