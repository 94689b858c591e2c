"""Multi-worker failures down to the last worker: workers killed (SIGKILL) and hung (SIGSTOP)
one after another until one is left, which serves everything whatever its role; a worker busy
computing for longer than the watchdog timeout is not taken for a hung one; a request whose
forward fails is ended alone, its workers live on. Tokens are exact (float64) throughout."""

from __future__ import annotations

import os
import signal
import time

import pytest
from faults import POISON, SLOW, worker_env
from test_multi_worker import WORKLOADS, _options, _reference, _run, _settle, _tokens

from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.multi import make_engine
from sangam.sampling_params import SamplingParams

# (layout, [(outputs seen, worker, signal)]): every worker but one is lost, the survivor's role
# is the one that had to take over the other's work.
CHAOS = {
    "only-a-prefill-worker-left": (
        dict(mode="hybrid", prefill_workers=2, decode_workers=2, overflow_threshold=8),
        [(3, 2, signal.SIGKILL), (7, 0, signal.SIGSTOP), (11, 3, signal.SIGKILL)]),
    "only-a-decode-worker-left": (
        dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
        [(3, 0, signal.SIGKILL), (7, 2, signal.SIGSTOP)]),
}


@pytest.mark.parametrize("case", list(CHAOS))
def test_workers_lost_one_after_another_down_to_the_last(paths, case):
    layout, blows = CHAOS[case]
    reqs = WORKLOADS["llada"]
    want = _reference(paths["llada"], "llada")
    engine = make_engine(EngineConfig(**_options(paths["llada"], **layout),
                                      watchdog_timeout=3.0))
    seen = []

    def strike(out):
        seen.append(out)
        for after, worker, sig in blows:
            if len(seen) == after:
                os.kill(engine.worker_states()[worker].pid, sig)

    try:
        outs = _run(engine, reqs, on_output=strike)
        survivor = ({*range(len(engine.roles))} - {w for _, w, _ in blows}).pop()
        assert sorted(engine.dead_workers) == sorted(w for _, w, _ in blows)
        assert _tokens(outs) == want
        assert engine.placement.counters.restarts > 0
        # The survivor alone takes new requests of every size that fits its pool, and serves
        # them in full.
        again = [(f"{rid}-again", *rest) for rid, *rest in reqs[:6]]
        outs = _run(engine, again)
        assert {rid.removesuffix("-again"): o for rid, o in _tokens(outs).items()} == {
            rid: want[rid] for rid, *_ in reqs[:6]}
        _settle(engine)
        # The last one lost: nothing can serve, and the front says so.
        os.kill(engine.worker_states()[survivor].pid, signal.SIGKILL)
        engine.add_request("last", [5, 6, 7], SamplingParams(max_tokens=8, block_length=4))
        deadline = time.monotonic() + 30
        with pytest.raises(RuntimeError, match="every worker is dead"):
            while time.monotonic() < deadline:
                engine.step()
    finally:
        engine.shutdown()


def test_a_busy_worker_is_not_hung(paths, tmp_path, monkeypatch):
    """A prefill worker whose forward computes for 3x the watchdog timeout (no report meanwhile)
    is busy, not hung: its heartbeats show its loop using the CPU."""
    for name, value in worker_env(tmp_path, spin_seconds=6.0).items():
        monkeypatch.setenv(name, value)
    reqs = WORKLOADS["llada"][:6]
    want = {rid: _reference(paths["llada"], "llada")[rid] for rid, *_ in reqs}
    slow = ("slow", SLOW + [5, 6], SamplingParams(max_tokens=8, block_length=4), None, [])
    engine = make_engine(EngineConfig(**_options(paths["llada"], mode="disaggregated",
                                                 prefill_workers=1, decode_workers=1),
                                      watchdog_timeout=2.0))
    try:
        start = time.monotonic()
        outs = _run(engine, [slow, *reqs])
        assert time.monotonic() - start > 6.0  # it did spin
        assert engine.dead_workers == [] and engine.placement.counters.restarts == 0
        assert outs.pop("slow").finish_reason == "length"
        assert _tokens(outs) == want
    finally:
        engine.shutdown()


def test_a_failing_request_is_ended_alone_on_workers(paths, tmp_path, monkeypatch):
    """A request whose forward raises (on whichever worker runs it) ends with an error; the
    requests batched with it, and its workers, go on."""
    for name, value in worker_env(tmp_path, poison=True).items():
        monkeypatch.setenv(name, value)
    reqs = WORKLOADS["dream"][:10]
    want = {rid: _reference(paths["dream"], "dream")[rid] for rid, *_ in reqs}
    poisoned = ("poisoned", POISON + [7], SamplingParams(max_tokens=8, block_length=4), None,
                [])
    engine = make_engine(EngineConfig(**_options(paths["dream"], mode="hybrid",
                                                 prefill_workers=1, decode_workers=1,
                                                 overflow_threshold=8)))
    try:
        outs = _run(engine, [*reqs[:5], poisoned, *reqs[5:]])
        failed = outs.pop("poisoned")
        assert failed.finished and failed.finish_reason == "error"
        assert "poisoned request" in failed.error
        assert _tokens(outs) == want
        assert engine.dead_workers == []
        _settle(engine)
    finally:
        engine.shutdown()


def test_deaths_are_noticed_while_idle(paths, caplog):
    """With nothing in flight, workers killed are declared dead within a poll (logged, the
    gauge drops), not at the next request; the last one's death fails the engine, so /health
    answers 503 (issue #36)."""
    engine = AsyncEngine(EngineConfig(**_options(paths["llada"], num_workers=3)))

    def alive() -> float:
        return dict((name, value) for name, _, value in engine.gauges())["sangam_workers_alive"]

    def soon(cond) -> bool:
        deadline = time.monotonic() + 5  # well within a heartbeat timeout
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.05)
        return cond()

    try:
        assert alive() == 3
        pids = [w.pid for w in engine.engine.worker_states()]
        for pid in pids[:2]:
            os.kill(pid, signal.SIGKILL)
        assert soon(lambda: alive() == 1)
        assert sum("is dead" in r.getMessage() for r in caplog.records) == 2
        assert engine.dead is None
        os.kill(pids[2], signal.SIGKILL)
        assert soon(lambda: engine.dead is not None)
        assert "every worker is dead" in str(engine.dead)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def paths(llada_path, dream_path):
    return {"llada": llada_path, "dream": dream_path}
