"""Discrete-event simulation of a Sangam deployment: N workers, one front.

The policy objects are the engine's own (docs/design.md §1): the front is the policy core's
``FrontCore`` (``Placement`` decides where each block runs, when K/V moves and what waits for
memory, as for the engine's front), and every worker keeps its requests in a ``WorkerCore``
over a ``BatchBuilder`` and a ``PageAllocator``, as a worker process does; the front's orders
and the workers' reports are the engine's messages (``sched/messages.py``). What this module
supplies is what the engine's front and workers supply around those cores: a transport (an
order reaches a simulated worker at once; a worker's report reaches the front at the end of
its iteration), a clock (the event queue's), and the forward and the link, replaced: an
iteration lasts what the cost model (:mod:`sangam.bench.cost_model`) says for its batch
composition, the tokens each forward commits are drawn from a distribution (:class:`StepModel`,
per request and block; for a uniform-state model, DiffusionGemma, the forwards each canvas
takes, every canvas row through the LM head), and a K/V transfer takes its whole pages'
bytes over the link's bandwidth, one transfer at a time per sender and per receiver. A worker
may be a tensor-parallel group of GPUs (``tensor_parallel_size``): its forwards cost a rank's
share plus the group's collectives, its KV pool is every rank's memory left after its share of
the weights, and its ranks send their shares of a transfer at once, each over its own link.

With layer-wise streaming, a forward's first transfer to each receiver (``Request.streamed``,
as the engine's worker picks it) sends layer l while layer l+1 computes: it starts when the
forward's first layer is done and ends at the latest of (link free + transfer) and (forward end
+ one layer's transfer), so only ``max(0, transfer - compute) + transfer / layers`` is exposed;
the forward's other transfers go whole after it.

``tests/test_differential.py`` runs a trace through this simulator and through the engine's
front and workers and requires the same decisions and the same timelines.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sangam.bench.cost_model import (
    BF16_BYTES,
    CALIBRATED,
    GPUS,
    LINKS,
    MODELS,
    Coefficients,
    CostModel,
    ModelGeometry,
    Span,
    TensorParallel,
    kv_pool_pages,
)
from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.steps import GeometricSteps, StepModel
from sangam.bench.traces import TraceRequest
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.block_cursor import FULL_REFRESH, BlockCursor
from sangam.sched.front_core import FrontCore
from sangam.sched.messages import (
    BlockDone,
    Drop,
    KVReceived,
    KVSent,
    Order,
    Prefill,
    ReceiveKV,
)
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import NeverFits, Placed
from sangam.sched.prefix_cache import PrefixCache, caches_prefixes, request_page_keys
from sangam.sched.request import CONTINUES, Request, StepOutcome
from sangam.sched.window_rings import WindowRings, ring_for
from sangam.sched.worker_core import WorkerCore


@dataclass
class _Worker:
    """One simulated worker: what a worker process keeps of its requests (``WorkerCore``, over
    its pool and BatchBuilder), the iteration in flight, and its links."""

    index: int
    role: str
    core: WorkerCore
    started: float = 0.0  # when the iteration in flight (or the last one) began
    in_flight: bool = False
    send_free: float = 0.0  # when the outbound link is next free
    recv_free: float = 0.0  # when the inbound link is next free
    busy_s: float = 0.0
    load: float = 0.0  # BatchBuilder.load as the iteration in flight was scheduled
    iterations: int = 0
    batch_sum: int = 0
    prefill_tokens: int = 0


@dataclass
class _Draws:
    """What the step model decides of one request, wherever its blocks run: how long its
    response is, and what each block's forwards commit (drawn once per block)."""

    index: int
    gen_len: int
    blocks_to_decode: int  # the request stops after this block (its output ends there)
    prompt: list[int] | None = None  # its token ids, when the trace gives them (shared prompts)
    plan: tuple[int, list[int]] = (-1, [])  # (block, tokens each of its forwards commits)
    thresholds: dict[int, float] | None = None  # block -> its threshold (load-adaptive)
    transfer_s: float = 0.0  # exposed K/V transfer time, summed over blocks


@dataclass
class _State:
    """What a worker runs a request with (the engine's DecodeState): its cursor and its forwards
    so far. The front keeps one at the start of the request's next block; an order carries a
    copy, as a message carries a pickled state, and a K/V transfer carries the sender's."""

    cursor: BlockCursor
    draws: _Draws
    num_forwards: int = 0

    def copy(self) -> _State:
        return _State(self.cursor.copy(), self.draws, self.num_forwards)


@dataclass
class SimResult:
    config: SimConfig
    qps: float
    records: list[dict]
    workers: list[dict]
    makespan: float


_ITER_DONE, _LANDED, _ARRIVAL = 0, 1, 2  # event kinds; at equal times, in this order


class Simulator:
    """The engine's front core and worker cores on a simulated clock: the front's orders reach
    the simulated workers (``_deliver``) as a worker process handles them, and each worker's
    reports reach the front at the end of its iteration, its forwards lasting what the cost
    model says."""

    def __init__(self, config: SimConfig, coefficients: Coefficients | None = None,
                 steps: StepModel | None = None,
                 geometry: tuple[ModelGeometry, int] | None = None):
        """``geometry`` (shape, dtype bytes): the model when ``config.model`` is CALIBRATED."""
        self.config = config
        if config.model == CALIBRATED:
            if geometry is None:
                raise ValueError("model 'calibrated' needs the geometry of a calibration file")
            self.geom, dtype_bytes = geometry
        else:
            self.geom, dtype_bytes = MODELS[config.model], BF16_BYTES
        gpu = GPUS[config.gpu]
        tp = TensorParallel.on(gpu, config.tensor_parallel_size, config.enable_expert_parallel)
        self.cost = CostModel(self.geom, coefficients or Coefficients.defaults(gpu), dtype_bytes,
                              tp)
        self.steps = steps or GeometricSteps()
        # A hybrid pool (as the engine decides, pool_layout.window_ring): each seat's ring of
        # sliding-window pages, then the full layers' pages.
        g = self.geom
        self.ring = ring_for(config.kv_pool, g.name,
                             g.sliding_window if g.full_layers < g.layers else 0, g.canvas,
                             config.page_size, config.token_budget,
                             config.mode == "colocated", self.prefix_caching)
        self.window_pages = self.ring.pages * config.deployment.scheduler.batch_cap \
            if self.ring else 0
        self.num_pages = config.num_pages or kv_pool_pages(
            g, gpu, config.page_size, config.memory_fraction, tp=tp.size,
            ring_pages=self.window_pages)
        self.link_bw = LINKS[config.link]
        self._params = config.request_params  # threshold_under: the engine's
        self._load = 0.0  # of the worker whose iteration is being planned or completed

    # One run.
    def run(self, trace: Sequence[TraceRequest], qps: float = math.nan) -> SimResult:
        cfg = self.config
        deployment = cfg.deployment
        self._workers = [  # as the engine builds each worker's parts
            _Worker(i, role, WorkerCore(self._builder(deployment), cfg.layerwise_kv_streaming))
            for i, role in enumerate(deployment.roles)]
        self._transfer_ids = itertools.count()
        self._streamed: set[tuple[int, int]] = set()  # (sender, transfer id) streamed
        self.front = FrontCore(deployment, [self.num_pages] * len(self._workers),
                               self._deliver)
        self.placement = self.front.placement
        self._events: list = []
        self._seq = 0
        self._records: list[dict] = []
        self._now = 0.0
        for i, t in enumerate(trace):
            self._push(t.arrival_time, _ARRIVAL, (i, t))
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            self._now = now
            if kind == _ARRIVAL:
                self._arrive(*payload)
            elif kind == _LANDED:
                self._land(*payload)
            else:
                self._iteration_done(payload)
            self.front.place()
            self._kick()
        if len(self._records) != len(trace):
            raise RuntimeError(f"simulation stalled with {len(trace) - len(self._records)} of "
                               f"{len(trace)} requests unfinished (KV pool too small?)")
        makespan = self._now
        workers = [{"worker": w.index, "role": w.role, "iterations": w.iterations,
                    "busy_s": w.busy_s, "utilization": w.busy_s / makespan if makespan else 0,
                    "mean_batch": w.batch_sum / w.iterations if w.iterations else 0,
                    "prefill_tokens": w.prefill_tokens} for w in self._workers]
        return SimResult(cfg, qps, sorted(self._records, key=lambda r: r["id"]), workers,
                         makespan)

    @property
    def prefix_caching(self) -> bool:
        """As the engine decides (``caches_prefixes``): the model's finished K/V is exact when
        it is block-causal or uniform-state."""
        cfg = self.config
        return caches_prefixes(cfg.block_causal or bool(self.geom.canvas),
                               cfg.enable_prefix_caching, cfg.kv_pool)

    def _builder(self, deployment) -> BatchBuilder:
        allocator = PageAllocator(self.num_pages)
        cache = PrefixCache(allocator) if self.prefix_caching else None
        rings = None if self.ring is None else WindowRings(PageAllocator(self.window_pages),
                                                           self.ring)
        return BatchBuilder(allocator, deployment.scheduler, cache, rings)

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    def _arrive(self, index: int, t: TraceRequest) -> None:
        """A request reaches the front: its cursor, as the engine's decode state builds it."""
        cfg = self.config
        b = cfg.block_length
        out = t.gen_len if cfg.max_tokens is None else min(t.gen_len, cfg.max_tokens)
        want = out if cfg.max_tokens is None else cfg.max_tokens
        causal = cfg.block_causal  # the block grid from position 0; no refresh after block 0
        if self.geom.canvas:  # uniform-state: canvases after the prompt, as the engine's
            cursor = BlockCursor.for_canvases(t.prompt_len, want, self.geom.canvas)
        else:
            cursor = BlockCursor(t.prompt_len,
                                 BlockCursor.canvas_len(t.prompt_len, want, b, causal), b,
                                 cache=cfg.cache, refresh_interval=cfg.refresh_interval,
                                 prompt_refresh_interval=cfg.prompt_refresh_interval,
                                 block_causal=causal)
        draws = _Draws(index, out, cursor.blocks_for(out),
                       prompt=t.prompt if isinstance(t.prompt, list) else None)
        try:
            self.front.add(f"r{index}", t.arrival_time, cursor, state=_State(cursor, draws))
        except NeverFits as e:
            raise ValueError(f"request {index} can never fit a worker's KV pool: {e}") from None

    # The transport: the front's orders reach the simulated workers at once.
    def _deliver(self, w: int, m: Order) -> None:
        worker = self._workers[w]
        core = worker.core
        if isinstance(m, Prefill):
            st = core.parked_state(m.request_id) if m.state is None else m.state.copy()
            req = Request(m.request_id, m.arrival, st.cursor, seq=m.seq, state=st,
                          attempt=m.attempt, kv_dest=m.kv_dest, keep_pages=m.keep_pages,
                          stays=m.stays)
            if self.prefix_caching and st.draws.prompt is not None:
                req.page_keys = request_page_keys(st.cursor, st.draws.prompt,
                                                  self.config.page_size)
            core.take_block(req)
        elif isinstance(m, ReceiveKV):
            self._receive(worker, m)
        elif isinstance(m, Drop):
            core.drop(m.request_id)
        # PeerDead: no worker dies in a simulation.

    def _receive(self, d: _Worker, m: ReceiveKV) -> None:
        """K/V on its way to ``d``, which takes it into its parked canvas or fresh pages, or
        drains it (a drain asked for, or no room: the block is then placed again). It lands
        when the link is done: one transfer at a time per sender and per receiver; a streamed
        one started with the sender's forward."""
        seat = None
        if not m.drain:  # the receiver seats the sender's copy of the request
            st = m.progress.copy()
            seat = Request(m.request_id, m.arrival, st.cursor, seq=m.seq, state=st,
                           attempt=m.attempt, keep_pages=True,
                           starts_block=st.cursor.step == 0)
        key = (m.src, m.transfer_id)
        d.core.expect_kv(key, m.request_id, m.attempt, seat, m.num_pages)
        p, now = self._workers[m.src], self._now
        start, end = self.transfer_window(p.send_free, d.recv_free, p.started, now,
                                          m.num_pages, key in self._streamed)
        p.send_free = d.recv_free = end
        if not m.drain:
            self.front.requests[m.request_id].state.draws.transfer_s += end - now
        self._push(end, _LANDED, (d.index, key))

    def transfer_window(self, send_free: float, recv_free: float, forward_start: float,
                        now: float, num_pages: int, streamed: bool) -> tuple[float, float]:
        """When a transfer of ``num_pages`` whole pages (as the engine sends them; a TP
        group's ranks send their shares at once) posted at ``now`` by a forward that began at
        ``forward_start`` occupies the sender's and the receiver's links, free from
        ``send_free`` and ``recv_free``: streamed, from the forward's first layer on (see the
        module's docstring); otherwise after the forward."""
        xfer = self.cost.kv_bytes(num_pages * self.config.page_size) / self.link_bw
        if streamed:
            layer_compute = (now - forward_start) / self.geom.layers
            start = max(send_free, recv_free, forward_start + layer_compute)
            return start, max(start + xfer, now + xfer / self.geom.layers)
        start = max(send_free, recv_free, now)
        return start, start + xfer

    def _land(self, dst: int, key: tuple[int, int]) -> None:
        """A transfer's last byte reached ``dst``: seated or drained, reported."""
        r, seated = self._workers[dst].core.kv_arrived(key, True, self._now)
        self.front.report(dst, KVReceived(r.request_id, r.attempt, key[0], key[1], seated, 0,
                                          r.pages if seated else [], False), self._now)

    # Iterations.
    def _kick(self) -> None:
        """Start an iteration on every idle worker that has something to run."""
        now = self._now
        for w in self._workers:
            if w.in_flight:
                continue
            batch = w.core.schedule(now)
            if batch is None:
                continue  # nothing, or memory-blocked; a later event frees pages
            # The load a load-adaptive block's threshold follows: the engine's worker reads
            # BatchBuilder.load once the batch is scheduled.
            w.load = self._load = w.core.builder.load
            spans = [self._span(r) for r in batch.requests]
            dt = self.cost.iteration_time(spans)
            w.in_flight, w.started = True, now
            w.iterations += 1
            w.busy_s += dt
            w.batch_sum += len(spans)
            w.prefill_tokens += batch.prefill_tokens
            self._push(now + dt, _ITER_DONE, (w, batch))

    def _span(self, r: Request) -> Span:
        """A request's part of the forward: its cursor's span, the keys it attends, and an LM
        row per mask left in its block (none for a prefill chunk)."""
        c = r.cursor
        start, end = c.span()
        if r.chunk_admitted:
            rows = 0
        elif c.uniform:  # every canvas row, every step
            rows = c.block_length
        else:
            rows = sum(self.block_plan(r.state.draws, c)[c.step:])
        return Span(end - start, c.keys_attended(end), rows,
                    c.block_length if c.block_causal else 0)

    def _iteration_done(self, payload: tuple[_Worker, object]) -> None:
        """Every request's step, the outcomes applied, then the worker's report (refreshes
        run, K/V sent, blocks done) as the front reads it."""
        w, batch = payload
        now = self._now
        w.in_flight = False
        self._load = w.load
        out = w.core.complete(batch, [self._advance(r) for r in batch.requests], w.started, now)
        report = out.refresh_reports(now - w.started)
        for ship in out.ships:
            r = ship.request
            tid = next(self._transfer_ids)
            if ship.streamed:
                self._streamed.add((w.index, tid))
            nbytes = int(self.cost.kv_bytes(len(ship.pages) * self.config.page_size))
            report.append(KVSent(r.request_id, r.attempt, r.kv_dest, tid, len(ship.pages),
                                 nbytes, 0, r.state.copy(), ship.drain, True))
        for ev in report + out.end_reports():
            p = self.front.report(w.index, ev, now)
            if isinstance(ev, BlockDone) and p is not None:
                p.state.num_forwards = ev.forwards  # the front's state catches up
                if ev.finished:
                    self._finish(p)

    def block_commits(self, request_id: str, block: int, block_length: int,
                      threshold: float | None = None) -> list[int]:
        """The tokens each forward of a request's block commits: a function of (seed, request,
        block, threshold), so a block run again (after a drained transfer) at the same
        threshold commits the same, as the model would, whatever the order of events."""
        rng = random.Random(f"{self.config.seed}:{request_id}:{block}")
        return self.steps.block_commits(rng, block_length, block,
                                        self.config.threshold if threshold is None else threshold)

    def block_plan(self, draws: _Draws, cursor: BlockCursor) -> list[int]:
        """``block_commits`` of the block ``cursor`` is at (drawn once per block): over its
        masks (a block-causal block 0 starts with the prompt's tail)."""
        if draws.plan[0] != cursor.block:
            # A load-adaptive block's threshold, as the engine's DecodeState.set_load sets it
            # when the block's first forward runs: the worker's load then.
            threshold = self._params.threshold_under(self._load)
            if self.config.min_threshold is not None:
                draws.thresholds = (draws.thresholds or {}) | {cursor.block: threshold}
            draws.plan = (cursor.block, self.block_commits(
                f"r{draws.index}", cursor.block, cursor.block_masks(cursor.block), threshold))
        return draws.plan[1]

    def _advance(self, r: Request) -> StepOutcome:
        """One forward of a request's block, as the step model commits it: moves the worker's
        cursor (a prefill chunk commits nothing, and stores its K/V)."""
        c, st = r.cursor, r.state
        st.num_forwards += 1
        if r.chunk_admitted:
            c.store_chunk()
            return CONTINUES
        block_done = c.step + 1 == len(self.block_plan(st.draws, c))
        finished = block_done and c.block + 1 == st.draws.blocks_to_decode
        force = block_done and not finished and self._triggered(r.request_id, c)
        c.advance(block_done, finished, force)
        return StepOutcome(block_done, finished)

    def _triggered(self, request_id: str, c: BlockCursor) -> bool:
        """Whether the adaptive trigger refreshes the request's next block fully: drawn per
        (seed, request, block), so a block run again decides the same."""
        rate = self.config.adaptive_refresh_rate
        if not rate or c.block_refresh(c.block + 1) == FULL_REFRESH:
            return False
        return random.Random(f"{self.config.seed}:{request_id}:{c.block}:refresh").random() \
            < rate

    def _finish(self, p: Placed) -> None:
        m, draws = p.metrics, p.state.draws
        self._records.append({
            "id": draws.index, "arrival": m.arrival_time, "finish": m.finish_time,
            "latency": m.e2e_latency, "ttfb": m.time_to_first_block,
            "queueing": m.queueing_time, "decode": m.decode_time,
            "transfer": draws.transfer_s, "forwards": m.num_steps,
            "prompt_len": p.cursor.prompt_len, "gen_len": draws.gen_len,
            "canvas_tokens": draws.blocks_to_decode * p.cursor.block_length,
            "threshold": (sum(draws.thresholds.values()) / len(draws.thresholds)
                          if draws.thresholds else None),  # its blocks' mean: load-adaptive
        })


def simulate(config: SimConfig, trace: Sequence[TraceRequest], qps: float = math.nan,
             coefficients: Coefficients | None = None, steps: StepModel | None = None,
             geometry: tuple[ModelGeometry, int] | None = None) -> SimResult:
    return Simulator(config, coefficients, steps, geometry).run(trace, qps)

