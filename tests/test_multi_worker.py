"""Multi-worker serving: worker processes, every mode, K/V transfer, failures, shutdown.

Everything runs in float64 on CPU and must give exactly the single-request reference's tokens
(docs/design.md §2, batch invariance: not even the serving mode may change them).
"""

import dataclasses
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from sangam import LLM
from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.front import tokens_per_forward
from sangam.engine.interface import SteppedEngine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.multi import make_engine
from sangam.engine.multi.front import MultiWorkerEngine
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.validation import new_state
from sangam.sampling_params import SamplingParams
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.block_cursor import BlockCursor
from sangam.sched.config import SchedulerConfig
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.request import BLOCK_DONE, CONTINUES, Request, RequestStatus

PAGE_SIZE = 4
NUM_PAGES = 48  # three of the largest canvases (64 tokens): decode workers run out of room
RULES = [dict(unmasking="threshold", threshold=0.9), dict(unmasking="threshold", threshold=0.5),
         dict(unmasking="factor", factor=1.0), dict(unmasking="topk", tokens_per_step=2)]
LAYOUTS = {
    "colocated": dict(num_workers=3),
    "1P2D": dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
    "2P1D-streaming": dict(mode="disaggregated", prefill_workers=2, decode_workers=1,
                           layerwise_kv_streaming=True),
    "hybrid-2P1C": dict(mode="hybrid", prefill_workers=2, decode_workers=1,
                        overflow_threshold=8),
}


def _options(path, **layout):
    return dict(model=path, device="cpu", dtype="float64", page_size=PAGE_SIZE,
                num_pages=NUM_PAGES, **layout)


def _workload(n: int, seed: int):
    rng = random.Random(seed)
    nucleus = random.Random(-seed)  # its own stream: the other fields stay as they were
    infill = random.Random(seed + 1000)  # another: suffixes (infilling) and priorities
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, 150) for _ in range(rng.choice([1, 5, 15, 16, 17, 31, 40]))]
        params = SamplingParams(
            max_tokens=rng.choice([8, 13, 24]), block_length=rng.choice([4, 8]),
            cache=rng.choice(["dual", "dual", "prefix", "none"]), seed=i,
            temperature=rng.choice([0.0, 0.0, 2.0]), stop_at_eos=rng.random() < 0.5,
            top_p=nucleus.choice([1.0, 0.5]), frequency_penalty=nucleus.choice([0.0, 0.8]),
            min_tokens=nucleus.choice([0, 5]), logprobs=nucleus.choice([None, 2]),
            min_p=nucleus.choice([0.0, 0.1]), priority=infill.choice([0, 0, 1, -1]),
            **rng.choice(RULES))
        suffix = [infill.randrange(2, 150) for _ in range(infill.choice([0, 0, 4]))]
        reqs.append((f"r{i}", prompt, params, None, suffix))
    return reqs


def _prompt(req: tuple) -> dict:
    """A workload request as an ``LLM.generate`` prompt."""
    return {"prompt_token_ids": req[1], "suffix_token_ids": req[4]}


# One workload per architecture; tests use all of it or a part, so that the (slow) reference
# decoding runs once per architecture.
WORKLOADS = {"llada": _workload(26, seed=7), "dream": _workload(26, seed=8)}
# (refresh_interval, prompt_refresh_interval), as tests/test_engine.py's.
CADENCES = [(1, 1), (2, 1), (1, 2), (3, 2), (1000, 1)]


def _cadence_workload(n: int, seed: int):
    """Requests of several blocks, each with a cache and a refresh cadence."""
    rng = random.Random(seed)
    return [(f"c{rid}", prompt, dataclasses.replace(
                params, cache=rng.choice(["dual", "prefix"]), max_tokens=rng.choice([16, 24]),
                block_length=4, refresh_confidence=rng.choice([0.0, 0.0, 0.4]),
                **dict(zip(("refresh_interval", "prompt_refresh_interval"),
                           rng.choice(CADENCES)))),
             arrival, suffix)
            for rid, prompt, params, arrival, suffix in _workload(n, seed)]


CADENCE_WORKLOADS = {"llada": _cadence_workload(16, seed=17),
                     "dream": _cadence_workload(16, seed=18)}


@pytest.fixture(scope="module")
def paths(llada_path, dream_path):
    return {"llada": llada_path, "dream": dream_path}


_REFERENCES = {}


def _reference(path, arch, workloads=WORKLOADS):
    """:func:`_outcome` per request of ``workloads[arch]``, from the single-request reference
    decoder."""
    key = (arch, id(workloads))
    if key not in _REFERENCES:
        lm = LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))
        out = {}
        for rid, prompt, params, _, suffix in workloads[arch]:
            st = new_state(lm, prompt, params, random.Random(0), suffix)
            ReferenceDecoder(lm.model).run(st)
            tokens = st.output_token_ids()
            top = st.output_top_logprobs(len(tokens)) if params.logprobs else None
            out[rid] = (tokens, st.num_forwards, _top_ids(top), tokens_per_forward(st))
        _REFERENCES[key] = out
    return _REFERENCES[key]


def _run(engine, reqs, seed=3, on_output=None, timeout=120.0):
    """Submit a few requests between steps; return the final outputs by request id."""
    rng = random.Random(seed)
    pending = list(reqs)
    done = {}
    deadline = time.monotonic() + timeout
    while pending or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"stuck; unfinished: {list(engine.requests)}"
        for _ in range(rng.randint(0, 3)):
            if pending:
                engine.add_request(*pending.pop(0))
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                done[out.request_id] = out
    return done


def _settle(engine, timeout=20.0):
    """Wait until every live worker has freed all pages and finished every transfer."""
    deadline = time.monotonic() + timeout
    while True:
        engine.step()
        states = [s for s in engine.worker_states() if s.alive]
        if all(s.free_pages == s.num_pages and s.open_transfers == 0 for s in states):
            return
        assert time.monotonic() < deadline, f"workers did not settle: {states}"


def _top_ids(top):
    return None if top is None else [[t for t, _ in alt] for alt in top]


def _outcome(o):
    """What must not depend on the layout: tokens, forwards, the alternatives' token ids, the
    parallelism reported."""
    return o.token_ids, o.num_forwards, _top_ids(o.top_logprobs), o.metrics["tokens_per_forward"]


def _tokens(outs):
    return {rid: _outcome(o) for rid, o in outs.items()}


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (workers, and the launcher that forked them)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    out, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - out
        out |= frontier
    return {p for p in out if _pid_alive(p)}


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout=20.0):
    deadline = time.monotonic() + timeout
    while any(_pid_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"orphan workers: {[p for p in pids if _pid_alive(p)]}"
        time.sleep(0.1)


def _check_transfers(engine, outs, reqs):
    """Bytes of every transfer = pages x layers x 2 (K, V) x bytes of one layer's page."""
    cfg = engine.loaded.config
    page_bytes = PAGE_SIZE * cfg.num_kv_heads * cfg.head_dim * 8  # float64
    assert all(s.layer_page_bytes == page_bytes for s in engine.worker_states())
    per_page = cfg.num_layers * 2 * page_bytes
    total = {rid: BlockCursor.for_request(params, len(prompt), suffix_len=len(suffix)).total_len
             for rid, prompt, params, _, suffix in reqs}
    records = [r for r in engine.transfers if not r.drained]
    assert records, "no K/V was transferred"
    for r in records:
        assert r.num_pages == math.ceil(total[r.request_id] / PAGE_SIZE)
        assert r.bytes_sent == r.num_pages * per_page
        assert r.ok and r.bytes_received == r.bytes_sent
    for rid, out in outs.items():
        pages = math.ceil(total[rid] / PAGE_SIZE)
        assert out.metrics["kv_bytes"] == out.metrics["kv_transfers"] * pages * per_page
    assert sum(o.metrics["kv_bytes"] for o in outs.values()) == engine.counters.kv_bytes


def test_choosing_the_workers_devices_leaves_cuda_uninitialized(monkeypatch):
    """A node picks its workers' devices, then forks them: the default device is counted
    through NVML (torch.cuda.device_count), not torch.cuda.is_available, which initializes
    CUDA and so breaks it in every forked child."""
    import torch

    from sangam.engine.multi.launcher import worker_device

    def poisons_fork():
        raise AssertionError("torch.cuda.is_available() initializes CUDA before the fork")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    config = EngineConfig(mode="disaggregated", prefill_workers=1, decode_workers=1)
    for count, want in ((2, "cuda:1"), (0, "cpu")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert worker_device(config, 1) == want


def test_workers_on_one_node_never_share_a_gpu():
    from sangam.engine.multi.launcher import validate

    two = dict(mode="disaggregated", prefill_workers=1, decode_workers=1)
    for bad in (dict(device="cuda:1"), dict(devices="cuda:0,cuda:0")):
        with pytest.raises(ValueError, match="would share a GPU"):
            validate(EngineConfig(**two, **bad))
    for good in (dict(device="cuda"), dict(devices="cuda:1,cuda:0"), dict(device="cpu"),
                 dict(device="cuda:1", mode="colocated", num_workers=1)):
        validate(EngineConfig(**{**two, **good}))


def test_nodes_run_whole_workers_unless_there_are_fewer_workers_than_nodes():
    from sangam.engine.multi.launcher import node_processes, validate

    assert [node_processes(3, 2, 2, r) for r in (0, 1)] == [
        [(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1)]]
    # One worker of four ranks on two nodes: its group spans them.
    assert [node_processes(1, 4, 2, r) for r in (0, 1)] == [[(0, 0), (0, 1)], [(0, 2), (0, 3)]]
    addr = dict(dist_init_addr="10.0.0.1:29500")
    validate(EngineConfig(tensor_parallel_size=2, nnodes=2, **addr))
    for bad in (dict(num_workers=4, nnodes=3), dict(nnodes=2)):
        with pytest.raises(ValueError, match="would run no process"):
            validate(EngineConfig(**bad, **addr))


# Scheduler additions for multi-worker serving (no processes).


def test_builder_seat_and_detach():
    alloc = PageAllocator(16)
    b = BatchBuilder(alloc, SchedulerConfig(page_size=4, max_batch_size=1))
    req = Request("a", 0.0, BlockCursor(3, 8, 4))
    req.pages = alloc.allocate(req.cursor.num_pages(4))
    with pytest.raises(ValueError, match="DECODE"):
        b.seat(req)
    req.mark_admitted(0.0)
    req.cursor.advance(block_done=False, finished=False)
    req.mark_step_done(0.0, CONTINUES)
    b.seat(req)
    other = Request("b", 0.0, BlockCursor(3, 8, 4))
    other.pages, other.status = alloc.allocate(3), RequestStatus.DECODE
    with pytest.raises(ValueError, match="no free seat"):
        b.seat(other)
    batch = b.schedule(1.0)
    assert batch.decodes == [req] and not batch.prefills
    with pytest.raises(ValueError, match="last scheduled batch"):
        b.detach("a")
    req.cursor.advance(block_done=True, finished=False)
    b.step_done(req, 1.0, BLOCK_DONE)  # block 0 done: WAITING again
    pages = list(req.pages)
    assert b.detach("a") is req and req.pages == pages  # forgotten, pages kept
    assert not b.has_work and alloc.num_used == 6
    b.add(req)  # the next block's re-prefill, on the pages it holds
    assert b.schedule(2.0).prefills == [req] and alloc.num_used == 6


def test_block_progress_carries_all_a_block_changes():
    """What crosses the control plane per block (BlockProgress) brings a copy taken at the
    block's start to the state after it: tokens, confidences, top logprobs, counters, the end
    and the stop search's text."""
    import copy

    import numpy as np

    from sangam.decoding.state import DecodeState
    from sangam.engine import messages as msg

    params = SamplingParams(max_tokens=20, block_length=8, logprobs=2, stop=["zz"])
    st = DecodeState(list(range(2, 12)), params, 159, frozenset([1]), False)
    for _ in range(2):  # two whole blocks, committed a few positions at a time
        start = copy.deepcopy(st)
        block = st.cursor.block
        while st.cursor.block == block:
            s, e = st.cursor.block_bounds()
            masked = s + (st.tokens[s:e] == 159).nonzero()[0][:3]
            st.commit(masked, len(masked), masked + 20, np.linspace(0.5, 0.9, len(masked)))
            st.record_top(masked, np.full((len(masked), 2), -0.5), np.stack([masked] * 2, 1))
        msg.catch_up(start, msg.loads(msg.dumps(msg.block_progress(st, block))))
        assert start.__dict__.keys() == st.__dict__.keys()
        for k, v in st.__dict__.items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(getattr(start, k), v), k
            elif k == "cursor":  # its geometry is fixed; its position is the record
                assert start.cursor.record == v.record, k
            elif k not in ("stop_text", "params", "host_buffers"):  # (those arrays, above)
                assert getattr(start, k) == v, k
    st.stop_after(12, "zz")
    start = copy.deepcopy(st)
    start.finish(None)
    msg.catch_up(start, msg.block_progress(st, 1))
    assert (start.finished, start.finish_reason, start.stop_len, start.stop_string) == (
        True, "stop", 12, "zz")
    assert start.output_token_ids() == st.output_token_ids()


def test_busy_worker_loop_reports_at_least_every_second():
    """A worker loop with work but nothing new (e.g. a send waiting on a slow receiver) still
    reports, so the front's watchdog only flags loops that stopped; an idle one stays quiet."""
    from sangam.engine import messages as msg
    from sangam.engine.multi import worker as worker_mod

    sent = []
    worker = worker_mod.TransferWorker(0, BatchBuilder(PageAllocator(8), SchedulerConfig()),
                                       None, None)
    w = worker_mod.WorkerProcess(worker, None)
    w._handled = 3
    w.send = lambda m: sent.append(msg.loads(msg.dumps(m)))
    worker.core.take_block(Request("a", 0.0, BlockCursor(4, 16, 16)))  # work to do
    w.flush()
    assert len(sent) == 1 and sent[0].busy and sent[0].handled == 3
    w.flush()
    assert len(sent) == 1  # nothing changed, too soon
    w._reported_at -= worker_mod._KEEPALIVE_S  # a second passes
    w.flush()
    assert len(sent) == 2 and sent[1].busy and not sent[1].events
    worker.core.drop("a")
    w.flush()  # busy -> idle is a change: reported once
    w._reported_at -= 5 * worker_mod._KEEPALIVE_S
    w.flush()
    assert len(sent) == 3 and not sent[2].busy


# Every mode gives the reference tokens.


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_modes_match_reference(paths, arch, layout):
    reqs = WORKLOADS[arch]
    want = _reference(paths[arch], arch)
    opts = _options(paths[arch], **LAYOUTS[layout])
    if layout == "colocated":  # through the public API, shutdown included
        before = _descendants(os.getpid())
        llm = LLM(**opts)
        pids = _descendants(os.getpid()) - before  # the workers and their launcher
        assert {s.pid for s in llm.engine.worker_states()} < pids and len(pids) == 4
        assert isinstance(llm.engine, MultiWorkerEngine) and isinstance(llm.engine, SteppedEngine)
        outs = llm.generate([_prompt(r) for r in reqs], [r[2] for r in reqs])
        got = {rid: _outcome(o) for (rid, *_), o in zip(reqs, outs)}
        by_worker = llm.engine.placement.counters.prefills_by_worker
        assert len(by_worker) == 3 and min(by_worker.values()) > 0  # all three worked
        llm.shutdown()
        _wait_gone(pids, timeout=5)
        assert got == want
        return
    engine = make_engine(EngineConfig(**opts))
    try:
        outs = _run(engine, reqs)
        assert _tokens(outs) == want
        _check_transfers(engine, outs, reqs)
        if "streaming" in layout:
            # A forward streams its first transfer to each receiver, every layer's send posted
            # during it; more to the same receiver go whole after it (sends to one receiver
            # match its receives in posting order, as NCCL does: no tags are used).
            layers = {r.streamed_layers for r in engine.transfers}
            assert layers <= {0, engine.loaded.config.num_layers} and max(layers) > 0
        if layout.startswith("hybrid"):
            assert engine.placement.counters.overflow_prefills > 0
        assert engine.dead_workers == []
        _settle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch,layout", [("llada", "colocated"), ("dream", "colocated"),
                                         ("llada", "1P2D"), ("dream", "1P2D"),
                                         ("llada", "2P1D-streaming"), ("dream", "hybrid-2P1C")])
def test_refresh_cadence_matches_reference_in_every_mode(paths, arch, layout):
    """Blocks that start from cached K/V continue on the canvas holder; a refresh that ends its
    block on a prefill worker ships its K/V anyway, and the next block starts there."""
    reqs = CADENCE_WORKLOADS[arch]
    engine = make_engine(EngineConfig(**_options(paths[arch], **LAYOUTS[layout])))
    try:
        outs = _run(engine, reqs)
        assert _tokens(outs) == _reference(paths[arch], arch, CADENCE_WORKLOADS)
        if layout != "colocated":
            _check_transfers(engine, outs, reqs)
        assert engine.placement.counters.restarts == 0
        _settle(engine)
    finally:
        engine.shutdown()


def test_load_adaptive_thresholds_travel_with_their_blocks(paths):
    """A block's load-adaptive threshold is set by the worker that starts it and used by every
    worker that runs it: each response equals the reference decoder run with the thresholds the
    response reports."""
    lm = LoadedModel.load(EngineConfig(model=paths["llada"], device="cpu", dtype="float64"))
    params = SamplingParams(max_tokens=16, block_length=4, threshold=0.9, min_threshold=0.2,
                            stop_at_eos=False, refresh_interval=2)
    reqs = [(f"t{i}", [random.Random(i).randrange(2, 150) for _ in range(9)], params, None, [])
            for i in range(12)]
    engine = make_engine(EngineConfig(**_options(paths["llada"], **LAYOUTS["1P2D"]),
                                      max_batch_size=4))
    try:
        outs = _run(engine, reqs)
        lowered = 0
        for rid, prompt, *_ in reqs:
            got = outs[rid].block_thresholds
            assert len(got) == 4 and all(0.2 <= t <= 0.9 for t in got)
            lowered += sum(t < 0.9 for t in got)
            st = new_state(lm, prompt, params, random.Random(0))
            st.block_thresholds[:] = got
            ReferenceDecoder(lm.model).run(st)
            assert outs[rid].token_ids == st.output_token_ids(), rid
        assert lowered > 0
        _settle(engine)
    finally:
        engine.shutdown()


def test_failed_transfer_is_retried(paths):
    """A decode worker that cannot take a transfer drains it; the refresh is redone."""
    reqs = WORKLOADS["llada"][:16]
    want = {rid: _reference(paths["llada"], "llada")[rid] for rid, *_ in reqs}
    engine = make_engine(EngineConfig(**_options(paths["llada"], mode="disaggregated",
                                                 prefill_workers=1, decode_workers=1)))
    try:
        engine.placement.num_pages[1] = 10 * NUM_PAGES  # a stale view: worker 1 overcommitted
        outs = _run(engine, reqs)
        assert _tokens(outs) == want
        counters = engine.placement.counters
        assert counters.failed_transfers > 0 and counters.restarts > 0
        _settle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("workloads,tp", [(WORKLOADS, 1), (CADENCE_WORKLOADS, 1),
                                          (WORKLOADS, 2)],
                         ids=["full-refresh", "cadences", "full-refresh-tp2"])
def test_aborts_free_everything(paths, workloads, tp):
    """Aborts at any point (queued, refreshing, K/V in flight, decoding; with cadences also a
    block continuing on its holder without a refresh) leak no page and leave no transfer
    hanging; the other requests are unaffected, and so is a request resubmitted under an
    aborted one's id while news of the old one is still in flight. With workers of two
    tensor-parallel ranks too (every rank's transfers mirrored)."""
    reqs = workloads["dream"]
    want = _reference(paths["dream"], "dream", workloads)
    by_id = {r[0]: r for r in reqs}
    engine = make_engine(EngineConfig(**_options(paths["dream"], mode="hybrid",
                                                 prefill_workers=1, decode_workers=2,
                                                 overflow_threshold=40),
                                      tensor_parallel_size=tp))
    rng = random.Random(4)
    aborted, resubmitted = set(), set()

    def maybe_abort(out):
        live = sorted(set(engine.requests) - resubmitted)  # a resubmission runs to the end
        if live and rng.random() < 0.3:
            rid = rng.choice(live)
            assert engine.abort_request(rid).finish_reason == "abort"
            if rid not in resubmitted and rng.random() < 0.5:
                engine.add_request(*by_id[rid])
                resubmitted.add(rid)
            else:
                aborted.add(rid)

    try:
        outs = _run(engine, reqs, on_output=maybe_abort)
        assert aborted and resubmitted - aborted
        assert len(outs) + len(aborted) == len(reqs)
        assert _tokens(outs) == {rid: want[rid] for rid in outs}
        _settle(engine)
    finally:
        engine.shutdown()


# Failures and shutdown.


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout,sig", [
    pytest.param("llada", "1P2D", signal.SIGKILL, id="llada-1P2D-killed"),
    pytest.param("dream", "colocated", signal.SIGKILL, id="dream-colocated-killed"),
    # Hung: alive and silent. Only the watchdog can notice.
    pytest.param("llada", "1P2D", signal.SIGSTOP, id="llada-1P2D-hung"),
])
def test_killed_worker_loses_nothing(paths, arch, layout, sig):
    reqs = WORKLOADS[arch]
    want = _reference(paths[arch], arch)
    watchdog = 5.0
    engine = make_engine(EngineConfig(**_options(paths[arch], **LAYOUTS[layout]),
                                      watchdog_timeout=watchdog))
    victim = 1  # a decode worker in 1P2D
    blocks = []

    def kill_midway(out):
        blocks.append(out)
        if len(blocks) == 8:  # requests hold canvases and blocks are in flight everywhere
            os.kill(engine.worker_states()[victim].pid, sig)

    try:
        outs = {}
        if sig == signal.SIGSTOP:  # first: workers idle after work are not hung
            outs = _run(engine, reqs[:3])
            time.sleep(watchdog + 1)
            engine.step()
            assert engine.dead_workers == []
        outs |= _run(engine, reqs[len(outs):], on_output=kill_midway)
        assert engine.dead_workers == [victim]
        assert _tokens(outs) == want
        assert engine.placement.counters.restarts > 0
        assert not engine.worker_states()[victim].alive
        _settle(engine)
    finally:
        engine.shutdown()


def test_killed_worker_with_refresh_cadences(paths):
    """A request taken back has lost its cached K/V: its block restarts with a full refresh
    whatever its cadence says. Every request finishes; those never taken back are exact."""
    reqs = CADENCE_WORKLOADS["llada"]
    want = _reference(paths["llada"], "llada", CADENCE_WORKLOADS)
    engine = make_engine(EngineConfig(**_options(paths["llada"], **LAYOUTS["1P2D"])))
    blocks = []

    def kill_midway(out):
        blocks.append(out)
        if len(blocks) == 12:
            os.kill(engine.worker_states()[1].pid, signal.SIGKILL)

    try:
        outs = _run(engine, reqs, on_output=kill_midway)
        assert engine.dead_workers == [1] and set(outs) == {r[0] for r in reqs}
        restarted = {rid for rid, o in outs.items() if o.metrics["restarts"]}
        assert restarted and restarted != set(outs)
        assert all(o.finish_reason in ("stop", "length") for o in outs.values())
        assert {r: v for r, v in _tokens(outs).items() if r not in restarted} == {
            r: v for r, v in want.items() if r not in restarted}
        _settle(engine)
    finally:
        engine.shutdown()


_FRONT_SCRIPT = """
import faulthandler, signal, sys
from sangam import LLM, SamplingParams
faulthandler.register(signal.SIGUSR1, all_threads=True)
# Ctrl-C as in a terminal: a test runner may hand its children SIGINT ignored (SIG_IGN survives
# exec, and Python then installs no KeyboardInterrupt handler).
signal.signal(signal.SIGINT, signal.default_int_handler)
# No __main__ guard on purpose: workers must not re-run the user's script.
llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", num_workers=2, page_size=4,
          num_pages=64)
print(" ".join(str(s.pid) for s in llm.engine.worker_states()), flush=True)
while True:
    llm.generate(prompt_token_ids=[[5, 6, 7]] * 4,
                 sampling_params=SamplingParams(max_tokens=8, block_length=4))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_no_orphans_when_the_front_dies(paths, tmp_path, sig):
    script = tmp_path / "front.py"
    script.write_text(_FRONT_SCRIPT)
    front = subprocess.Popen([sys.executable, str(script), paths["llada"]],
                             stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in front.stdout.readline().split()]
        pids = _descendants(front.pid)  # the workers and their launcher
        assert len(workers) == 2 and set(workers) < pids
        time.sleep(1.0)  # generating
        front.send_signal(sig)
        try:
            front.wait(timeout=30)
        except subprocess.TimeoutExpired:  # show where the front is stuck (stderr is captured)
            with open(f"/proc/{front.pid}/status") as f:
                print(*[x for x in f if x.startswith("Sig")], file=sys.stderr)
            front.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            raise
        _wait_gone(pids)
    finally:
        front.kill()
        front.wait()


def _free_port_pair() -> int:
    """A port p with p + 1 free too (TCP store, ZeroMQ)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


# Node 1 whose worker's loop gets stuck in its third forward (as in a collective that never
# returns) while its heartbeat thread runs on: only the front's watchdog can tell.
_HANGING_NODE_SCRIPT = """
import sys, threading
from sangam.engine.model_runner import ModelRunner
from sangam.engine.multi import node
execute, calls = ModelRunner.execute, []
def execute_then_hang(self, *args, **kwargs):
    calls.append(None)
    if len(calls) == 3:
        threading.Event().wait()
    return execute(self, *args, **kwargs)
ModelRunner.execute = execute_then_hang
sys.exit(node.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("hang", [False, True], ids=["healthy", "remote-worker-hangs"])
def test_two_nodes_on_loopback(paths, tmp_path, hang):
    """Node 1's workers join node 0's front (ZeroMQ) and process group (TCP store). A remote
    worker declared hung is made to exit (no local parent can kill it) and loses nothing."""
    reqs = WORKLOADS["llada"][:12]
    want = {rid: _reference(paths["llada"], "llada")[rid] for rid, *_ in reqs}
    port = _free_port_pair()
    layout = dict(mode="disaggregated", prefill_workers=1, decode_workers=2, nnodes=2,
                  dist_init_addr=f"127.0.0.1:{port}", watchdog_timeout=5.0)
    opts = _options(paths["llada"], **layout)
    flags = []
    for k, v in opts.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    entry = ["-m", "sangam.engine.multi.node"]
    if hang:
        (tmp_path / "node.py").write_text(_HANGING_NODE_SCRIPT)
        entry = [str(tmp_path / "node.py")]
    node1 = subprocess.Popen([sys.executable, *entry, *flags, "--node-rank", "1"])
    try:
        llm = LLM(**opts)
        states = llm.engine.worker_states()
        remote = states[2].pid  # node 0 runs workers 0 (prefill) and 1, node 1 runs worker 2
        with open(f"/proc/{remote}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == node1.pid
        outs = llm.generate([_prompt(r) for r in reqs], [r[2] for r in reqs])
        assert {rid: _outcome(o) for (rid, *_), o in zip(reqs, outs)} == want
        assert any(r.dst == 2 for r in llm.engine.transfers)  # K/V crossed the "nodes"
        assert llm.engine.dead_workers == ([2] if hang else [])
        if hang:  # gone while the front still runs, and node 1 with it (its last worker)
            _wait_gone([remote], timeout=10)
            assert node1.wait(timeout=10) == 1
        llm.shutdown()
        assert node1.wait(timeout=30) == (1 if hang else 0)
        _wait_gone([s.pid for s in states] + list(_descendants(os.getpid())))
    finally:
        node1.kill()
        node1.wait()


@pytest.mark.slow
def test_async_engine_on_workers(paths):
    import asyncio

    reqs = WORKLOADS["dream"][:8]
    want = {rid: _reference(paths["dream"], "dream")[rid] for rid, *_ in reqs}
    engine = AsyncEngine(EngineConfig(**_options(paths["dream"], mode="disaggregated",
                                                 prefill_workers=1, decode_workers=1)))

    async def one(rid, prompt, params, _, suffix):
        outs = [o async for o in engine.generate(prompt, params, rid, suffix)]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        for a, b in zip(outs, outs[1:]):  # one output per block, each extending the last
            assert b.token_ids[:len(a.token_ids)] == a.token_ids
        return rid, _outcome(outs[-1])

    assert "disaggregated over 2 workers" in engine.describe()

    async def main():
        with pytest.raises(ValueError, match="workers of a multi-worker engine"):
            await engine.start_profile("unused")  # traces one process: refused, clearly
        return dict(await asyncio.gather(*(one(*r) for r in reqs)))

    pids = _descendants(os.getpid())
    try:
        assert asyncio.run(main()) == want
    finally:
        engine.shutdown()
    _wait_gone(pids, timeout=5)
