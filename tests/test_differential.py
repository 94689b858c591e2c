"""The simulator against the engine (docs/design.md §1: the simulator runs the engine's front
core and worker cores). One trace runs twice, with the same forward times (the simulator's
cost model), the same tokens per forward (its seeded step model) and the same link times:

- through ``Simulator``: ``FrontCore`` and ``WorkerCore`` on the simulator's event queue;
- through the engine's front and real ``Worker`` objects: the in-process ``Engine`` (one
  worker, messages and states handed over directly) or the multi-worker front over
  ``TransferWorker``s (every message and report pickled as on the wire), with stand-ins only for
  what no decision depends on: a runner that commits the step model's tokens instead of running
  a model, an in-process K/V transport, and the clock, which advances event by event as the
  simulator's does (the front's and the workers' ``clock``).

Every decision is recorded where both sides make it (``BatchBuilder.schedule``,
``Placement.place`` / ``kv_sent`` / ``kv_received``), and so is every report Placement hears,
with its times (``refreshed``, ``block_done``, ``block_continued``), and each finished request's
timeline (arrival, every refresh's queueing, start and end, every block's decode start and end,
its finish); the two sequences must be equal.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random
import types

import numpy as np
import pytest
import torch

from sangam.bench.cost_model import Span
from sangam.bench.sim import GeometricSteps, SimConfig, Simulator, StepModel
from sangam.bench.traces import TraceRequest
from sangam.config import EngineConfig
from sangam.engine import messages as msg
from sangam.engine.engine import Engine
from sangam.engine.front import Front
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.model_runner import step_outcome
from sangam.engine.multi.kv_transfer import Done
from sangam.engine.multi.worker import TransferWorker
from sangam.engine.worker import Worker
from sangam.models import read_config
from sangam.sampling_params import SamplingParams
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import Placement
from sangam.sched.worker_core import WorkerCore
from sangam.testing import make_tiny_checkpoint

BLOCK = 16
NUM_PAGES = 24  # per worker: a few canvases at a time, so requests wait for memory
TOKEN = 7  # what the stub commits (no stop id: requests run to their length)
_ITER_DONE, _LANDED, _ARRIVAL = 0, 1, 2  # the simulator's order at equal times

DEPLOYMENTS = {  # (mode, prefill or colocated workers, decode workers)
    "1C": ("colocated", 1, 0),  # the in-process Engine
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


def sim_config(deployment: str, cache: str, cadence: tuple[int, int] = (1, 1),
               model: str = "llada", **flags) -> SimConfig:
    mode, a, b = DEPLOYMENTS[deployment]
    workers = ({"num_workers": a} if mode == "colocated"
               else {"prefill_workers": a, "decode_workers": b})
    # theta = 64: every prefill worker is often that far behind, so hybrid overflow fires.
    return SimConfig(**{
        "model": model, "mode": mode, **workers, "token_budget": 256, "max_batch_size": 8,
        "overflow_threshold": 64, "block_length": BLOCK, "cache": cache,
        "num_pages": NUM_PAGES, "refresh_interval": cadence[0],
        "prompt_refresh_interval": cadence[1], **flags})


def _timeline(p) -> tuple:
    m = p.metrics
    return (p.request_id, m.arrival_time, tuple(m.prefill_queued), tuple(m.prefill_started),
            tuple(m.prefill_finished), tuple(m.decode_started), tuple(m.block_finished),
            m.finish_time, m.num_steps)


class Recorder:
    """The decisions and reports, with their times, in the order both sides make them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.log: list[tuple] = []
        self.timelines: dict[str, tuple] = {}
        schedule, place = BatchBuilder.schedule, Placement.place
        kv_sent, kv_received = Placement.kv_sent, Placement.kv_received
        refreshed, block_done = Placement.refreshed, Placement.block_done
        block_continued = Placement.block_continued

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
            self.log.append(("kv_sent", p and p.request_id, src, dest, drain, out))
            return out

        def rec_kv_received(placement, p, dst, ok, pages):
            self.log.append(("kv_received", p.request_id, dst, ok, len(pages)))
            return kv_received(placement, p, dst, ok, pages)

        def rec_refreshed(placement, p, worker, start, end, chunk=False):
            self.log.append(("refreshed", p.request_id, worker, start, end, chunk))
            return refreshed(placement, p, worker, start, end, chunk)

        def rec_block_done(placement, p, worker, finished, forwards, pages, now):
            self.log.append(("block_done", p.request_id, p.cursor.block, worker, finished,
                             forwards, len(pages), now))
            out = block_done(placement, p, worker, finished, forwards, pages, now)
            if finished:
                self.timelines[p.request_id] = _timeline(p)
            return out

        def rec_block_continued(placement, p, forwards, now):
            self.log.append(("block_continued", p.request_id, p.cursor.block, forwards, now))
            return block_continued(placement, p, forwards, now)

        monkeypatch.setattr(Placement, "refreshed", rec_refreshed)
        monkeypatch.setattr(Placement, "block_done", rec_block_done)
        monkeypatch.setattr(Placement, "block_continued", rec_block_continued)
        monkeypatch.setattr(BatchBuilder, "schedule", rec_schedule)
        monkeypatch.setattr(Placement, "place", rec_place)
        monkeypatch.setattr(Placement, "kv_sent", rec_kv_sent)
        monkeypatch.setattr(Placement, "kv_received", rec_kv_received)

    def take(self, builders: dict[int, int]) -> tuple[list[tuple], dict[str, tuple]]:
        """The log with builders named by worker index, and the finished timelines."""
        out = [(e[0], builders[e[1]], *e[2:]) if e[0] == "batch" else e for e in self.log]
        timelines, self.log, self.timelines = self.timelines, [], {}
        return out, timelines


# The engine's side.
class StubRunner:
    """Commits, for each request of a batch, what the simulator's step model says its forward
    commits (forced commits of masked positions in the block: no model runs)."""

    def __init__(self, worker: Worker, sim: Simulator):
        self.worker, self.sim = worker, sim

    def execute(self, states, pages, **_) -> list:
        rid_of = {id(r.state): rid for rid, r in self.worker.core.tasks.items()}
        outcomes = []
        for st in states:
            c = st.cursor
            masks = c.block_masks(c.block)  # as the simulator's block_plan
            plan = self.sim.block_commits(rid_of[id(st)], c.block, masks)
            s, e = c.block_bounds()
            masked = s + (st.tokens[s:e] == st.mask_token_id).nonzero()[0]
            k = len(masked) if c.step == len(plan) - 1 else plan[c.step]
            outcomes.append(step_outcome(st, st.commit(masked[:k], k, np.full(k, TOKEN),
                                                       np.ones(k))))
        transport = getattr(self.worker, "transport", None)
        if transport is not None:
            transport.in_forward = False  # sends opened from now on go after the forward
        return outcomes


class StubTransport:
    """An in-process data plane whose transfers take the simulator's link time (one at a time
    per sender and per receiver, whole pages; a send opened before the forward ran is a
    layer-wise stream)."""

    num_layers = 1
    device = "cpu"

    def __init__(self, deployment: Deployment, index: int):
        self.d, self.index = deployment, index
        self._pages: dict[int, int] = {}
        self._streamed: set[int] = set()
        self._landed: list[Done] = []
        self.num_open = 0
        self.in_forward = False

    @property
    def local(self) -> StubTransport:
        return self

    def open_send(self, dest: int) -> int:
        tid = next(self.d.transfer_ids)  # numbered as the simulator numbers its transfers
        if self.in_forward:
            self._streamed.add(tid)
        return tid

    def send_layers(self, dest, transfer_id, page_ids, layers) -> None:
        self._pages[transfer_id] = len(page_ids)

    def close_send(self, dest: int, transfer_id: int) -> tuple[int, bool]:
        pages = self._pages.pop(transfer_id)
        streamed = transfer_id in self._streamed
        self._streamed.discard(transfer_id)
        nbytes = int(self.d.sim.cost.kv_bytes(pages * self.d.config.page_size))
        self.d.start_transfer(self.index, dest, transfer_id, pages, nbytes, streamed)
        return nbytes, True

    def sends_throttled(self) -> bool:
        return False

    def receive(self, src: int, transfer_id: int, num_pages: int) -> None:
        self.num_open += 1

    def land(self, done: Done) -> None:
        self._landed.append(done)

    def poll(self) -> list[Done]:
        out, self._landed = self._landed, []
        self.num_open -= len(out)
        return out

    def scatter_received(self, done, pages) -> None:
        pass

    def peer_dead(self, peer: int) -> None:
        pass


# What layer-wise streaming hooks in a worker's model: nothing runs it here.
_NO_MODEL = types.SimpleNamespace(model=types.SimpleNamespace(
    attention_backend=types.SimpleNamespace(name="stub")))


class StubFront(Front):
    """The multi-worker front, its worker processes replaced by ``Deployment``'s workers: a
    message is pickled and handled at once (as a worker loop would, before its next forward);
    reports are pickled back when the deployment flushes them."""

    def __init__(self, config: EngineConfig, deployment: Deployment):
        self.d = deployment
        path = config.model
        loaded = LoadedModel.around(config, path, None, read_config(path),
                                    torch.device("cpu"), torch.float32)
        super().__init__(config, loaded, [NUM_PAGES] * len(config.deployment.roles))
        self.clock = lambda: deployment.now
        for i in range(len(config.deployment.roles)):
            builder = BatchBuilder(PageAllocator(NUM_PAGES), config.scheduler)
            w = TransferWorker(i, builder, None, StubTransport(deployment, i), _NO_MODEL,
                               config.layerwise_kv_streaming)
            w.runner = StubRunner(w, deployment.sim)
            w.clock = self.clock
            deployment.workers.append(w)

    def _send(self, worker: int, message: object) -> None:
        self.d.workers[worker].handle(msg.loads(msg.dumps(message)))

    def flush(self) -> None:
        for w in self.d.workers:
            events, iterations = msg.loads(msg.dumps((w.events, w.iterations)))
            w.events, w.iterations = [], []
            self._on_report(w.index, events, iterations)
        self._place()


class InProcess:
    """The in-process ``Engine`` (one worker: messages and states handed over as objects), its
    model runner replaced by the stub."""

    def __init__(self, config: EngineConfig, deployment: Deployment):
        self.engine = Engine(config)
        w = self.engine.worker
        w.runner = StubRunner(w, deployment.sim)
        self.engine.clock = w.clock = lambda: deployment.now
        deployment.workers.append(w)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def flush(self) -> None:
        e = self.engine
        w = e.worker
        events, iterations, w.events, w.iterations = w.events, w.iterations, [], []
        e._on_report(0, events, iterations)
        e._place()


class Deployment:
    """The front and its workers on the simulator's clock, cost model and links."""

    def __init__(self, model_path: str, sim: Simulator):
        self.sim, self.config = sim, sim.config
        c = sim.config
        self.engine_config = EngineConfig(
            model=model_path, device="cpu", dtype="float32", mode=c.mode, num_workers=c.num_workers,
            prefill_workers=c.prefill_workers, decode_workers=c.decode_workers,
            policy=c.policy, token_budget=c.token_budget, max_batch_size=c.max_batch_size,
            overflow_threshold=c.overflow_threshold, page_size=c.page_size, seed=c.seed,
            num_pages=NUM_PAGES, layerwise_kv_streaming=c.layerwise_kv_streaming)
        self.workers: list = []
        self.send_free: dict[int, float] = collections.defaultdict(float)
        self.recv_free: dict[int, float] = collections.defaultdict(float)
        self.started: dict[int, float] = {}  # each worker's forward start
        self.transfer_ids = itertools.count()
        self.in_flight: dict[int, tuple] = {}
        self.events: list = []
        self.seq = itertools.count()
        self.now = 0.0
        in_process = len(self.engine_config.deployment.roles) == 1
        self.front = (InProcess if in_process else StubFront)(self.engine_config, self)

    def push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), payload))

    def start_transfer(self, src: int, dst: int, transfer_id: int, num_pages: int,
                       nbytes: int, streamed: bool) -> None:
        _, end = self.sim.transfer_window(self.send_free[src], self.recv_free[dst],
                                          self.started[src], self.now, num_pages, streamed)
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
                w.poll_transfers()
            else:
                w = self.workers[payload]
                batch, start = self.in_flight.pop(payload)
                if isinstance(w, TransferWorker):
                    w.transport.in_forward = True
                w.run(batch, start)
            self.front.flush()
            finished += sum(o.finished for o in self.front._take_outputs())
            self._kick()
        return finished

    def _kick(self) -> None:
        for w in self.workers:
            if w.index in self.in_flight:
                continue
            batch = w.core.schedule(self.now)
            if batch is None:
                continue
            spans = []
            for r in batch.requests:
                st, c = r.state, r.cursor
                s, e = c.block_bounds()
                start, end = c.span()
                rows = 0 if r.chunk_admitted else int((st.tokens[s:e] == st.mask_token_id).sum())
                spans.append(Span(end - start, c.keys_attended(end), rows,
                                  c.block_length if c.block_causal else 0))
            self.in_flight[w.index] = (batch, self.now)
            self.started[w.index] = self.now
            self.push(self.now + self.sim.cost.iteration_time(spans), _ITER_DONE, w.index)


def run_both(model_path: str, config: SimConfig, monkeypatch: pytest.MonkeyPatch,
             steps: StepModel | None = None, trace: list[TraceRequest] | None = None
             ) -> tuple[list, list, Simulator]:
    """The decisions and reports of the simulator and of the engine on one trace; their
    finished requests' timelines are required equal here."""
    trace = make_trace() if trace is None else trace
    rec = Recorder(monkeypatch)
    sim = Simulator(config, steps=steps)
    result = sim.run(trace)
    assert len(result.records) == len(trace)
    simulated, sim_times = rec.take({id(w.core.builder): w.index for w in sim._workers})
    d = Deployment(model_path, Simulator(config, steps=steps))
    assert d.run(trace) == len(trace)
    served, served_times = rec.take({id(w.builder): w.index for w in d.workers})
    assert len(sim_times) == len(served_times) == len(trace)
    for rid, timeline in sim_times.items():
        assert timeline == served_times[rid], f"{rid}: simulator {timeline}, engine " \
            f"{served_times[rid]}"
    return simulated, served, sim


def assert_same(simulated: list, served: list) -> None:
    for i, (a, b) in enumerate(zip(simulated, served)):
        assert a == b, f"decision {i} differs: simulator {a}, engine {b}"
    assert len(simulated) == len(served)


@pytest.mark.parametrize("cache", ["dual", "prefix", "none"])
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_simulator_decides_as_the_engine(llada_path, deployment, cache, monkeypatch):
    simulated, served, sim = run_both(llada_path, sim_config(deployment, cache), monkeypatch)
    kinds = collections.Counter(e[0] for e in simulated)
    assert kinds["batch"] > 48 and kinds["place"] >= 48
    if DEPLOYMENTS[deployment][0] != "colocated" and cache != "none":
        assert kinds["kv_sent"] > 0
    if deployment == "1C":  # the in-process engine: requests wait for memory
        assert any(e[0] == "batch" and not e[4] for e in simulated)
    if deployment == "1P2C":  # overflow: blocks whose refresh runs on a decode worker
        counts = sim.placement.counters.prefills_by_worker
        assert counts.get(1, 0) + counts.get(2, 0) > 0
    assert_same(simulated, served)


@pytest.fixture(scope="module")
def sdar_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), arch="sdar", seed=1)


@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_simulator_decides_as_the_engine_for_block_causal_models(sdar_path, deployment,
                                                                 monkeypatch):
    """SDAR in every mode: one prefill per request (on a prefill worker, or overflowed), its
    K/V sent once, every block step where it went."""
    simulated, served, _ = run_both(sdar_path, sim_config(deployment, "dual", model="sdar"),
                                    monkeypatch)
    kinds = collections.Counter(e[0] for e in simulated)
    assert kinds["batch"] > 48 and kinds["place"] == 48  # placed once each: no re-prefill
    if DEPLOYMENTS[deployment][0] == "disaggregated":
        assert 0 < kinds["kv_sent"] <= 48
    assert_same(simulated, served)


@pytest.mark.parametrize("cadence", [(2, 1), (1, 2), (3, 2)], ids=["every2", "response", "3x2"])
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_simulator_follows_refresh_cadences_as_the_engine(llada_path, deployment, cadence,
                                                          monkeypatch):
    """Blocks that start from cached K/V continue where the canvas is, on both sides; only
    full refreshes are placed."""
    simulated, served, _ = run_both(llada_path, sim_config(deployment, "dual", cadence),
                                    monkeypatch)
    places = sum(e[0] == "place" for e in simulated)
    blocks = sum(-(-t.gen_len // BLOCK) for t in make_trace())
    assert 48 <= places < blocks  # every request's first block, fewer than all blocks
    assert_same(simulated, served)


def _shipped_ends(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records the ships of refreshes that ended their block (their next block starts from
    cached K/V, on the receiver; or, drained, is placed again)."""
    out = []
    complete = WorkerCore.complete

    def counting(core, batch, outcomes, start, end):
        events = complete(core, batch, outcomes, start, end)
        out.extend(s for s in events.ships if s.block != s.request.cursor.block)
        return events

    monkeypatch.setattr(WorkerCore, "complete", counting)
    return out


@pytest.mark.parametrize("deployment", ["1P2D", "2P1D", "1P2C"])
def test_refreshes_that_end_their_block_ship_as_the_engine(llada_path, deployment, monkeypatch):
    """A refresh on a prefill worker that commits its whole block, when the next block starts
    from cached K/V: its K/V still ships, and the receiver starts that block (many steps commit
    a whole block of 16 at a mean of 10 tokens per step)."""
    shipped_ends = _shipped_ends(monkeypatch)
    simulated, served, _ = run_both(llada_path, sim_config(deployment, "dual", (2, 1)),
                                    monkeypatch, GeometricSteps(10.0))
    assert any(not s.drain for s in shipped_ends)
    assert_same(simulated, served)


@pytest.mark.parametrize("deployment", ["1P2D", "2P1D", "1P2C"])
def test_drained_transfers_as_the_engine(llada_path, deployment, monkeypatch):
    """Layer-wise streaming: a forward's first refresh for each receiver sends while the
    forward runs, so when that refresh commits its whole block (and the next is placed again
    for its own full refresh) the send is already under way: it ships drained, takes its link
    time, and the receiver discards it, on both sides."""
    shipped_ends = _shipped_ends(monkeypatch)
    config = sim_config(deployment, "dual", layerwise_kv_streaming=True)
    simulated, served, sim = run_both(llada_path, config, monkeypatch, GeometricSteps(10.0))
    assert any(s.drain for s in shipped_ends)
    drained = [e for e in simulated if e[0] == "kv_sent" and e[5]]
    assert drained and len(drained) < sum(e[0] == "kv_sent" for e in simulated)
    assert_same(simulated, served)


def test_hybrid_overflows_at_exactly_theta(llada_path, monkeypatch):
    """Hybrid overflow fires when every prefill worker has at least theta prefill tokens
    outstanding (docs/design.md §4.5: ">= theta"): pinned where a worker holds exactly theta
    and exactly theta - 1, on both sides. Request a (8 + 16 = 24 tokens of refresh) is placed
    on the idle prefill worker; b arrives before a's refresh ends: with theta = 24 it
    overflows to a decode worker, with theta = 25 it waits for the prefill worker."""
    trace = [TraceRequest(0.0, 8, 16), TraceRequest(1e-9, 8, 16)]
    for theta, b_worker in ((24, "decode"), (25, "prefill")):
        config = sim_config("1P2C", "dual", overflow_threshold=theta)
        simulated, served, sim = run_both(llada_path, config, monkeypatch, trace=trace)
        assert_same(simulated, served)
        places = {e[1]: e[2] for e in simulated if e[0] == "place"}
        assert places["r0"] == 0
        assert sim.placement.roles[places["r1"]] == b_worker, (theta, places)


def test_the_theta_pin_sees_the_prefill_load(llada_path, monkeypatch):
    """What the pin above stands on: when b is placed, the prefill worker's outstanding load is
    a's whole refresh."""
    loads = []
    place = Placement.place

    def recording(placement):
        if "r1" in placement.pending:
            loads.append(placement.router.load(0))
        return place(placement)

    monkeypatch.setattr(Placement, "place", recording)
    config = dataclasses.replace(sim_config("1P2C", "dual"), overflow_threshold=24)
    Simulator(config).run([TraceRequest(0.0, 8, 16), TraceRequest(1e-9, 8, 16)])
    assert loads == [24]
