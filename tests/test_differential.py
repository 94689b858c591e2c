"""The simulator against the engine (DESIGN.md §1: the simulator drives the engine's policy
objects). One trace runs twice, with the same forward times (the simulator's cost model) and
the same tokens per forward (its seeded step model):

- through ``Simulator``: Placement and WorkerCore driven by the simulator's own event loop;
- through the multi-worker front (``MultiWorkerEngine``) and real ``Worker`` loops, every
  message pickled as on the wire, with stand-ins only for what no decision depends on: a
  runner that commits the step model's tokens instead of running a model, an in-process K/V
  transport, and a clock that advances event by event as the simulator's does.

Every decision is recorded where both sides make it (``BatchBuilder.schedule``,
``Placement.place`` / ``kv_sent`` / ``kv_received``) and the two sequences must be equal.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random

import numpy as np
import pytest
import zmq

from sangam.bench.cost_model import Span
from sangam.bench.sim import SimConfig, Simulator
from sangam.bench.traces import TraceRequest
from sangam.config import EngineConfig
from sangam.engine.model_runner import StepResult
from sangam.engine.multi import front as front_mod
from sangam.engine.multi import messages as msg
from sangam.engine.multi.kv_transfer import Done
from sangam.engine.multi.worker import Worker
from sangam.sampling_params import SamplingParams
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import Placement

BLOCK = 16
NUM_PAGES = 24  # per worker: a few canvases at a time, so requests wait for memory
TOKEN = 7  # what the stub commits (no stop id: requests run to their length)
_ITER_DONE, _LANDED, _ARRIVAL = 0, 1, 2  # the simulator's order at equal times

DEPLOYMENTS = {  # (mode, prefill or colocated workers, decode workers)
    "2C": ("colocated", 2, 0),
    "1P2D": ("disaggregated", 1, 2),
    "2P1D": ("disaggregated", 2, 1),
    "1P2C": ("hybrid", 1, 2),
}


def make_trace(n: int = 48, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(40.0)
        out.append(TraceRequest(t, rng.randint(8, 100), rng.randint(8, 64)))
    return out


def sim_config(deployment: str, cache: str, cadence: tuple[int, int] = (1, 1)) -> SimConfig:
    mode, a, b = DEPLOYMENTS[deployment]
    workers = ({"num_workers": a} if mode == "colocated"
               else {"prefill_workers": a, "decode_workers": b})
    # theta = 64: every prefill worker is often that far behind, so hybrid overflow fires.
    return SimConfig(mode=mode, **workers, token_budget=256, max_batch_size=8,
                     overflow_threshold=64, block_length=BLOCK, cache=cache, num_pages=NUM_PAGES,
                     refresh_interval=cadence[0], prompt_refresh_interval=cadence[1])


class Recorder:
    """The decisions, in the order both sides make them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.log: list[tuple] = []
        self.clock = [0.0]
        schedule, place = BatchBuilder.schedule, Placement.place
        kv_sent, kv_received = Placement.kv_sent, Placement.kv_received

        def rec_schedule(builder, now):
            batch = schedule(builder, now)
            if not batch.is_empty:
                self.log.append(("batch", id(builder), now,
                                 [r.request_id for r in batch.prefills],
                                 [r.request_id for r in batch.decodes]))
            return batch

        def rec_place(placement):
            out = place(placement)
            self.log.extend(("place", d.request_id, d.worker, d.kv_dest, d.keep_pages)
                            for d in out)
            return out

        def rec_kv_sent(placement, p, src, dest, drain):
            out = kv_sent(placement, p, src, dest, drain)
            self.log.append(("kv_sent", p and p.request_id, src, dest, out))
            return out

        def rec_kv_received(placement, p, dst, ok, pages):
            self.log.append(("kv_received", p.request_id, dst, ok, len(pages)))
            return kv_received(placement, p, dst, ok, pages)

        monkeypatch.setattr(BatchBuilder, "schedule", rec_schedule)
        monkeypatch.setattr(Placement, "place", rec_place)
        monkeypatch.setattr(Placement, "kv_sent", rec_kv_sent)
        monkeypatch.setattr(Placement, "kv_received", rec_kv_received)

    def take(self, builders: dict[int, int]) -> list[tuple]:
        """The log with builders named by worker index."""
        out = [(e[0], builders[e[1]], *e[2:]) if e[0] == "batch" else e for e in self.log]
        self.log = []
        return out


# The engine's side.
class StubRunner:
    """Commits, for each request of a batch, what the simulator's step model says its forward
    commits (forced commits of masked positions in the block: no model runs)."""

    def __init__(self, worker: Worker, sim: Simulator):
        self.worker, self.sim = worker, sim

    def execute(self, states, pages) -> StepResult:
        rid_of = {id(t.payload): rid for rid, t in self.worker.core.tasks.items()}
        done = []
        for st in states:
            plan = self.sim.block_commits(rid_of[id(st)], st.block, st.params.block_length)
            s, e = st.block_bounds()
            masked = s + (st.tokens[s:e] == st.mask_token_id).nonzero()[0]
            k = len(masked) if st.step == len(plan) - 1 else plan[st.step]
            done.append(st.commit(masked[:k], k, np.full(k, TOKEN), np.ones(k)))
        return StepResult(done, {})


class StubTransport:
    """An in-process data plane whose transfers take the simulator's link time (one at a time
    per sender and per receiver, whole pages)."""

    num_layers = 1
    device = "cpu"

    def __init__(self, deployment: Deployment, index: int):
        self.d, self.index = deployment, index
        self._ids = itertools.count()
        self._pages: dict[int, int] = {}
        self._landed: list[Done] = []
        self.num_open = 0

    def open_send(self, dest: int) -> int:
        return next(self._ids)

    def send_layers(self, dest, transfer_id, page_ids, layers) -> None:
        self._pages[transfer_id] = len(page_ids)

    def close_send(self, dest: int, transfer_id: int) -> int:
        pages = self._pages.pop(transfer_id)
        nbytes = int(self.d.sim.cost.kv_bytes(pages * self.d.config.page_size))
        self.d.start_transfer(self.index, dest, transfer_id, nbytes)
        return nbytes

    def receive(self, src: int, transfer_id: int, num_pages: int) -> None:
        self.num_open += 1

    def land(self, done: Done) -> None:
        self._landed.append(done)

    def poll(self) -> list[Done]:
        out, self._landed = self._landed, []
        self.num_open -= len(out)
        return out

    def scatter_into(self, buffer, pages) -> None:
        pass

    def peer_dead(self, peer: int) -> None:
        pass


class _WorkerSocket:
    def __init__(self, inbox: collections.deque, index: int):
        self.inbox, self.ident = inbox, f"w{index}".encode()

    def send(self, data: bytes) -> None:
        self.inbox.append([self.ident, data])


class _FrontSocket:
    """The front's ROUTER socket: a message to a worker is handled by it at once (as its loop
    would, before its next forward); reports queue until the front reads them."""

    def __init__(self, deployment: Deployment):
        self.d = deployment
        self.inbox: collections.deque = collections.deque()

    def send_multipart(self, parts: list[bytes]) -> None:
        ident, data = parts
        m = msg.loads(data)
        if ident.startswith(b"w") and not isinstance(m, msg.Shutdown):
            w = self.d.workers[int(ident[1:])]
            w._handle(m)
            w._handled += 1

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.inbox)

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.popleft()

    def close(self) -> None:
        pass


class StubFront(front_mod.MultiWorkerEngine):
    """The front with its process and socket layer replaced by ``Deployment``'s workers."""

    deployment: Deployment

    def _start(self) -> None:
        d = self.deployment
        self._sock.close()
        self._sock = _FrontSocket(d)
        for i in range(len(self.roles)):
            builder = BatchBuilder(PageAllocator(NUM_PAGES), self.config.page_size,
                                   self.config.policy, self.config.effective_token_budget,
                                   self.config.max_batch_size)
            w = Worker(i, _WorkerSocket(self._sock.inbox, i), builder, None,
                       StubTransport(d, i))
            w.runner = StubRunner(w, d.sim)
            d.workers.append(w)
            hello = msg.Hello(i, 0, "stub", "cpu", NUM_PAGES, 0, ())
            self._workers[i] = front_mod._WorkerInfo(hello, 0.0, NUM_PAGES)

    def _check_workers(self) -> None:
        pass  # no processes to watch: failure detection has its own tests


class Deployment:
    """The front and its workers on the simulator's clock and cost model."""

    def __init__(self, model_path: str, sim: Simulator):
        self.sim, self.config = sim, sim.config
        c = sim.config
        mode = c.mode
        self.engine_config = EngineConfig(
            model=model_path, device="cpu", dtype="float32", mode=mode, num_workers=c.num_workers,
            prefill_workers=c.prefill_workers, decode_workers=c.decode_workers,
            policy=c.policy, token_budget=c.token_budget, max_batch_size=c.max_batch_size,
            overflow_threshold=c.overflow_threshold, page_size=c.page_size, seed=c.seed)
        self.workers: list[Worker] = []
        self.send_free: dict[int, float] = collections.defaultdict(float)
        self.recv_free: dict[int, float] = collections.defaultdict(float)
        self.in_flight: dict[int, tuple] = {}
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        StubFront.deployment = self
        self.front = StubFront(self.engine_config)

    def push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), payload))

    def start_transfer(self, src: int, dst: int, transfer_id: int, nbytes: int) -> None:
        start = max(self.send_free[src], self.recv_free[dst], self.now)
        end = start + nbytes / self.sim.link_bw
        self.send_free[src] = self.recv_free[dst] = end
        self.push(end, _LANDED, (dst, Done(transfer_id, src, False, True, nbytes, None)))

    def run(self, trace: list[TraceRequest]) -> int:
        """Serve the trace; returns how many requests finished."""
        rng = random.Random(1)
        for i, t in enumerate(trace):
            self.push(t.arrival_time, _ARRIVAL, (i, t))
        finished = 0
        while self.events:
            self.now, kind, _, payload = heapq.heappop(self.events)
            if kind == _ARRIVAL:
                i, t = payload
                params = SamplingParams(
                    max_tokens=t.gen_len, block_length=BLOCK, cache=self.config.cache,
                    temperature=0.0, refresh_interval=self.config.refresh_interval,
                    prompt_refresh_interval=self.config.prompt_refresh_interval)
                prompt = [rng.randint(2, 150) for _ in range(t.prompt_len)]
                self.front.add_request(f"r{i}", prompt, params, arrival_time=t.arrival_time)
            elif kind == _LANDED:
                dst, done = payload
                w = self.workers[dst]
                w.transport.land(done)
                for d in w.transport.poll():
                    w._transfer_done(d)
            else:
                w = self.workers[payload]
                w._run(*self.in_flight.pop(payload))
            for w in self.workers:
                w._flush()
            finished += sum(o.finished for o in self.front.step())
            self._kick()
        return finished

    def _kick(self) -> None:
        for w in self.workers:
            if w.index in self.in_flight:
                continue
            w.core.seat_ready()
            if not w.builder.has_work:
                continue
            batch = w._schedule(self.now)
            if batch is None:
                continue
            spans = [Span(r.prefill_cost, r.total_len, r.block_length) for r in batch.prefills]
            for r in batch.decodes:
                st = w.core.tasks[r.request_id].payload
                s, e = st.block_bounds()
                spans.append(Span(r.decode_span, r.total_len,
                                  int((st.tokens[s:e] == st.mask_token_id).sum())))
            self.in_flight[w.index] = (batch, self.now)
            self.push(self.now + self.sim.cost.iteration_time(spans), _ITER_DONE, w.index)


def run_both(model_path: str, deployment: str, cache: str, monkeypatch: pytest.MonkeyPatch,
             cadence: tuple[int, int] = (1, 1)) -> tuple[list, list, Simulator]:
    trace = make_trace()
    rec = Recorder(monkeypatch)
    sim = Simulator(sim_config(deployment, cache, cadence))
    result = sim.run(trace)
    assert len(result.records) == len(trace)
    simulated = rec.take({id(w.core.builder): w.index for w in sim._workers})
    d = Deployment(model_path, Simulator(sim_config(deployment, cache, cadence)))
    try:
        assert d.run(trace) == len(trace)
        served = rec.take({id(w.builder): w.index for w in d.workers})
        return simulated, served, sim
    finally:
        d.front.shutdown()


@pytest.mark.parametrize("cache", ["dual", "prefix", "none"])
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_simulator_decides_as_the_engine(llada_path, deployment, cache, monkeypatch):
    simulated, served, sim = run_both(llada_path, deployment, cache, monkeypatch)
    kinds = collections.Counter(e[0] for e in simulated)
    assert kinds["batch"] > 48 and kinds["place"] >= 48
    if DEPLOYMENTS[deployment][0] != "colocated" and cache != "none":
        assert kinds["kv_sent"] > 0
    if deployment == "1P2C":  # overflow: blocks whose refresh runs on a decode worker
        counts = sim.placement.counters.prefills_by_worker
        assert counts.get(1, 0) + counts.get(2, 0) > 0
    for i, (a, b) in enumerate(zip(simulated, served)):
        assert a == b, f"decision {i} differs: simulator {a}, engine {b}"
    assert len(simulated) == len(served)


@pytest.mark.parametrize("cadence", [(2, 1), (1, 2), (3, 2)], ids=["every2", "response", "3x2"])
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_simulator_follows_refresh_cadences_as_the_engine(llada_path, deployment, cadence,
                                                          monkeypatch):
    """Blocks that start from cached K/V continue where the canvas is, on both sides; only
    full refreshes are placed."""
    simulated, served, sim = run_both(llada_path, deployment, "dual", monkeypatch, cadence)
    places = sum(e[0] == "place" for e in simulated)
    blocks = sum(-(-t.gen_len // BLOCK) for t in make_trace())
    assert 48 <= places < blocks  # every request's first block, fewer than all blocks
    for i, (a, b) in enumerate(zip(simulated, served)):
        assert a == b, f"decision {i} differs: simulator {a}, engine {b}"
    assert len(simulated) == len(served)
