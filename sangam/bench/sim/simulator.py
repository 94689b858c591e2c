"""Discrete-event simulation of a Sangam deployment: N workers, one central placement.

The policy objects are the engine's own (docs/design.md §1): ``Placement`` decides where each block
runs, when K/V moves and what waits for memory, as it does for the multi-worker front; every
worker keeps its requests in a ``WorkerCore`` over a ``BatchBuilder`` and a ``PageAllocator``,
as a worker process does. Only the forward pass and the link are replaced: an iteration lasts
what the cost model (:mod:`sangam.bench.cost_model`) says for its batch composition, the tokens
each forward commits are drawn from a distribution (:class:`StepModel`, per request and
block), and a K/V transfer takes its whole pages' bytes over the link's bandwidth, one
transfer at a time per sender and per receiver. A worker may be a tensor-parallel group of
GPUs (``tensor_parallel_size``): its forwards cost a rank's share plus the group's collectives,
its KV pool is every rank's memory left after its share of the weights, and its ranks send
their shares of a transfer at once, each over its own link.

Per iteration of a worker, as the worker process: ``WorkerCore.schedule(now)``; the forward
takes ``cost(batch)`` seconds and moves each request's cursor as the step model says;
``WorkerCore.complete`` applies the outcomes; then, as the front reads the worker's report, the
refreshes run (``Placement.refreshed``), the K/V sent (``kv_sent``; the receiver expects it),
and the blocks that ended (``block_done``). When K/V lands the receiver seats the request
(``kv_received``). Modes and placement are ``Placement``'s (docs/design.md §4); see
``sangam/sched/placement.py``. With layer-wise streaming, layer l is sent while layer l+1
computes: a transfer starts when the forward's first layer is done and ends at the latest of
(link free + transfer) and (forward end + one layer's transfer), so only
``max(0, transfer - compute) + transfer / layers`` is exposed.

``tests/test_differential.py`` runs a trace through this simulator and through the front with
real worker loops and requires the same decisions.
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
from sangam.sampling_params import grid_canvas
from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.block_cursor import FULL_REFRESH, BlockCursor
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import NeverFits, Placed, Placement
from sangam.sched.prefix_cache import PrefixCache, request_page_keys
from sangam.sched.request import CONTINUES, Request, StepOutcome
from sangam.sched.worker_core import BlockEnded, Ship, Task, WorkerCore


@dataclass
class _Worker:
    """One simulated worker: its pool and BatchBuilder, and what a worker process keeps of its
    requests (``WorkerCore``, the worker process's own)."""

    index: int
    role: str
    core: WorkerCore
    batch: ScheduledBatch | None = None  # the iteration in flight
    started: float = 0.0
    send_free: float = 0.0  # when the outbound link is next free
    recv_free: float = 0.0  # when the inbound link is next free
    busy_s: float = 0.0
    load: float = 0.0  # BatchBuilder.load as the iteration in flight was scheduled
    iterations: int = 0
    batch_sum: int = 0
    prefill_tokens: int = 0


@dataclass
class _Live:
    """The simulator's view of one request."""

    index: int
    placed: Placed  # Placement's: its placement and metrics
    gen_len: int
    blocks_to_decode: int  # the request stops after this block (its output ends there)
    plan: tuple[int, list[int]] = (-1, [])  # (block, tokens each of its forwards commits)
    thresholds: dict[int, float] | None = None  # block -> its threshold (load-adaptive)
    forwards: int = 0  # as of the start of the current block
    transfer_s: float = 0.0  # exposed K/V transfer time, summed over blocks
    prompt: list[int] | None = None  # its token ids, when the trace gives them (shared prompts)

    @property
    def request(self) -> Request:
        return self.placed.request


@dataclass
class _Progress:
    """What a worker runs a request with (the engine's DecodeState): its forwards so far. The
    worker's view of the request carries a copy of the front's cursor, as the front's snapshot
    does; a K/V transfer carries the sender's copy to the receiver."""

    live: _Live
    forwards: int = 0


@dataclass
class _Transfer:
    """K/V on its way from ``src`` to ``dst`` (transfer ``key`` there)."""

    key: tuple[int, int]
    src: int
    dst: int


@dataclass
class SimResult:
    config: SimConfig
    qps: float
    records: list[dict]
    workers: list[dict]
    makespan: float


_ITER_DONE, _LANDED, _ARRIVAL = 0, 1, 2  # event kinds; at equal times, in this order


class Simulator:
    """Placement's decisions are the engine's own (``sangam.sched.placement``); each simulated
    worker does with them what a worker process does (``engine/multi/worker.py``), its
    forwards lasting what the cost model says."""

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
        self.num_pages = config.num_pages or kv_pool_pages(
            self.geom, gpu, config.page_size, config.memory_fraction, tp=tp.size)
        self.link_bw = LINKS[config.link]
        self._params = config.request_params  # threshold_under: the engine's
        self._load = 0.0  # of the worker whose iteration is being planned or completed

    # One run.
    def run(self, trace: Sequence[TraceRequest], qps: float = math.nan) -> SimResult:
        cfg = self.config
        deployment = cfg.deployment
        self._workers = [  # as the engine builds each worker's parts
            _Worker(i, role, WorkerCore(self._builder(deployment)))
            for i, role in enumerate(deployment.roles)]
        self._transfer_ids = itertools.count()
        self.placement = Placement(deployment, [self.num_pages] * len(self._workers))
        self._events: list = []
        self._seq = 0
        self._records: list[dict] = []
        self._now = 0.0
        lives = [(i, t) for i, t in enumerate(trace)]
        self._lives: dict[str, _Live] = {}
        for i, t in lives:
            self._push(t.arrival_time, _ARRIVAL, (i, t))
        while self._events:
            now, kind, _, payload = heapq.heappop(self._events)
            self._now = now
            if kind == _ARRIVAL:
                self._arrive(*payload)
            elif kind == _LANDED:
                self._land(payload)
            else:
                self._iteration_done(payload)
            self._place()
            self._kick()
        if len(self._records) != len(lives):
            raise RuntimeError(f"simulation stalled with {len(lives) - len(self._records)} of "
                               f"{len(lives)} requests unfinished (KV pool too small?)")
        makespan = self._now
        workers = [{"worker": w.index, "role": w.role, "iterations": w.iterations,
                    "busy_s": w.busy_s, "utilization": w.busy_s / makespan if makespan else 0,
                    "mean_batch": w.batch_sum / w.iterations if w.iterations else 0,
                    "prefill_tokens": w.prefill_tokens} for w in self._workers]
        return SimResult(cfg, qps, sorted(self._records, key=lambda r: r["id"]), workers,
                         makespan)

    def _builder(self, deployment) -> BatchBuilder:
        allocator = PageAllocator(self.num_pages)
        cache = PrefixCache(allocator) if self.config.prefix_caching else None
        return BatchBuilder(allocator, deployment.scheduler, cache)

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, payload))

    # The front's side: requests in, Placement's decisions out.
    def _arrive(self, index: int, t: TraceRequest) -> None:
        cfg = self.config
        b = cfg.block_length
        out = t.gen_len if cfg.max_tokens is None else min(t.gen_len, cfg.max_tokens)
        want = out if cfg.max_tokens is None else cfg.max_tokens
        if cfg.block_causal:  # the block grid from position 0; no refresh after block 0
            cursor = BlockCursor(t.prompt_len, grid_canvas(t.prompt_len, want, b), b,
                                 block_causal=True)
            blocks = -(-(t.prompt_len + out) // b) - t.prompt_len // b
        else:
            cursor = BlockCursor(t.prompt_len, -(-want // b) * b, b, cache=cfg.cache,
                                 refresh_interval=cfg.refresh_interval,
                                 prompt_refresh_interval=cfg.prompt_refresh_interval)
            blocks = -(-out // b)
        req = Request(f"r{index}", t.arrival_time, cursor)
        try:
            placed = self.placement.add(req)
        except NeverFits as e:
            raise ValueError(f"request {index} can never fit a worker's KV pool: {e}") from None
        self._lives[req.request_id] = _Live(
            index, placed, out, blocks, prompt=t.prompt if isinstance(t.prompt, list) else None)

    @staticmethod
    def _view(request: Request, cursor: BlockCursor) -> Request:
        """A worker's view of a request, on a copy of ``cursor`` (as a worker's copy of the
        request's state carries one)."""
        return Request(request.request_id, request.arrival_time, cursor.copy(),
                       priority=request.priority, seq=request.seq)

    def _place(self) -> None:
        for d in self.placement.place():
            live = self._lives[d.request_id]
            req = live.request
            view = self._view(req, req.cursor)
            if self.config.prefix_caching and live.prompt is not None:
                view.page_keys = request_page_keys(view.cursor, live.prompt,
                                                   self.config.page_size)
            self._workers[d.worker].core.take_block(Task(
                view, _Progress(live, live.forwards), d.attempt, d.kv_dest, d.keep_pages,
                stays=d.stays))

    def _drop(self, request_id: str, workers: set[int]) -> None:
        for i in workers:
            self._workers[i].core.drop(request_id)

    # Iterations.
    def _kick(self) -> None:
        """Start an iteration on every idle worker that has something to run."""
        now = self._now
        for w in self._workers:
            if w.batch is not None:
                continue
            batch = w.core.schedule(now)
            if batch is None:
                continue  # nothing, or memory-blocked; a later event frees pages
            # The load a load-adaptive block's threshold follows: the engine's worker reads
            # BatchBuilder.load once the batch is scheduled.
            w.load = self._load = w.core.builder.load
            spans = [self._span(r, t.payload.live)
                     for r, t in zip(batch.requests, w.core.batch_tasks(batch))]
            dt = self.cost.iteration_time(spans)
            w.batch, w.started = batch, now
            w.iterations += 1
            w.busy_s += dt
            w.batch_sum += len(spans)
            w.prefill_tokens += batch.prefill_tokens
            self._push(now + dt, _ITER_DONE, w)

    def _span(self, r: Request, live: _Live) -> Span:
        """A request's part of the forward: its cursor's span, the keys it attends, and an LM
        row per mask left in its block (none for a prefill chunk)."""
        c = r.cursor
        start, end = c.span()
        rows = 0 if r.chunk_admitted else sum(self.block_plan(live, c)[c.step:])
        return Span(end - start, c.keys_attended(end), rows,
                    c.block_length if c.block_causal else 0)

    def _iteration_done(self, w: _Worker) -> None:
        """In the worker's order: every request's step, the outcomes applied, then the reports
        (refreshes run, K/V sent, blocks done) as the front reads them."""
        now = self._now
        batch, w.batch = w.batch, None
        self._load = w.load
        tasks = w.core.batch_tasks(batch)
        outcomes = [self._advance(r, t.payload) for r, t in zip(batch.requests, tasks)]
        out = w.core.complete(batch, tasks, outcomes, w.started, now)
        for task, chunk in out.refreshed:
            current = self.placement.current(task.request.request_id, task.attempt)
            if current is not None:
                self.placement.refreshed(current, w.index, w.started, now, chunk)
        for ship in out.ships:
            if not ship.drain:  # a drained refresh ships nothing
                self._ship(ship, w)
        for ev in out.ended:
            if isinstance(ev, BlockEnded):
                self._block_ended(ev, w)

    def block_commits(self, request_id: str, block: int, block_length: int,
                      threshold: float | None = None) -> list[int]:
        """The tokens each forward of a request's block commits: a function of (seed, request,
        block, threshold), so a block run again (after a drained transfer) at the same
        threshold commits the same, as the model would, whatever the order of events."""
        rng = random.Random(f"{self.config.seed}:{request_id}:{block}")
        return self.steps.block_commits(rng, block_length, block,
                                        self.config.threshold if threshold is None else threshold)

    def block_plan(self, live: _Live, cursor: BlockCursor) -> list[int]:
        """``block_commits`` of the block ``cursor`` is at (drawn once per block): over its
        masks (a block-causal block 0 starts with the prompt's tail)."""
        if live.plan[0] != cursor.block:
            masks = cursor.block_length
            if cursor.block_causal and cursor.block == 0:
                masks -= cursor.prompt_len - cursor.block_origin
            # A load-adaptive block's threshold, as the engine's DecodeState.set_load sets it
            # when the block's first forward runs: the worker's load then.
            threshold = self._params.threshold_under(self._load)
            if self.config.min_threshold is not None:
                live.thresholds = (live.thresholds or {}) | {cursor.block: threshold}
            live.plan = (cursor.block, self.block_commits(live.request.request_id,
                                                          cursor.block, masks, threshold))
        return live.plan[1]

    def _advance(self, r: Request, progress: _Progress) -> StepOutcome:
        """One forward of a request's block, as the step model commits it: moves the worker's
        cursor (a prefill chunk commits nothing, and stores its K/V)."""
        c, live = r.cursor, progress.live
        progress.forwards += 1
        if r.chunk_admitted:
            c.store_chunk()
            return CONTINUES
        block_done = c.step + 1 == len(self.block_plan(live, c))
        finished = block_done and c.block + 1 == live.blocks_to_decode
        force = block_done and not finished and self._triggered(live, c)
        c.advance(block_done, finished, force)
        return StepOutcome(block_done, finished)

    def _triggered(self, live: _Live, c: BlockCursor) -> bool:
        """Whether the adaptive trigger refreshes the request's next block fully: drawn per
        (seed, request, block), so a block run again decides the same."""
        rate = self.config.adaptive_refresh_rate
        if not rate or c.block_refresh(c.block + 1) == FULL_REFRESH:
            return False
        rid = live.request.request_id
        return random.Random(f"{self.config.seed}:{rid}:{c.block}:refresh").random() < rate

    def _block_ended(self, ev: BlockEnded, w: _Worker) -> None:
        """A block ended on ``w``: the front catches up with the worker's cursor, then the next
        block runs on (``kept`` None) or is placed again, or the request is done."""
        progress = ev.task.payload
        live = progress.live
        current = self.placement.current(live.request.request_id, ev.task.attempt)
        if current is None:
            return
        live.forwards = progress.forwards
        c = ev.task.request.cursor
        live.request.cursor.catch_up(c.block, c.step, c.force_refresh)
        if ev.kept is None:
            self.placement.block_continued(current, live.forwards, self._now)
            return
        self._drop(live.request.request_id, self.placement.block_done(
            current, w.index, ev.finished, live.forwards, ev.kept, self._now))
        if ev.finished:
            self._finish(live)

    # K/V transfers.
    def _ship(self, ship: Ship, p: _Worker) -> None:
        """Send a refresh's K/V to its ``kv_dest``, which takes it into its parked canvas or
        fresh pages, or drains it when it has no room (the block is then placed again). A
        refresh that ended its block ships when the next block continues from its K/V: the
        receiver starts that block."""
        cfg, task, now = self.config, ship.task, self._now
        progress = task.payload
        live = progress.live
        rid = live.request.request_id
        current = self.placement.current(rid, task.attempt)
        drain = self.placement.kv_sent(current, p.index, task.kv_dest, drain=False)
        d = self._workers[task.kv_dest]
        key = (p.index, next(self._transfer_ids))
        seat = None
        if not drain:  # the receiver's view catches up with the sender's (its cursor copied)
            view = self._view(live.request, task.request.cursor)
            seat = Task(view, _Progress(live, progress.forwards), task.attempt, None, True,
                        starts_block=view.cursor.step == 0)
        d.core.expect_kv(key, rid, task.attempt, seat, live.placed.pages_needed)
        # Whole pages travel, as the engine sends them; a TP group's ranks send theirs at once.
        xfer = self.cost.kv_bytes(len(ship.pages) * cfg.page_size) / self.link_bw
        if self.config.layerwise_kv_streaming:
            layer_compute = (now - p.started) / self.geom.layers
            start = max(p.send_free, d.recv_free, p.started + layer_compute)
            end = max(start + xfer, now + xfer / self.geom.layers)
        else:
            start = max(p.send_free, d.recv_free, now)
            end = start + xfer
        p.send_free = d.recv_free = end
        if not drain:
            live.transfer_s += end - now
        self._push(end, _LANDED, _Transfer(key, p.index, task.kv_dest))

    def _land(self, t: _Transfer) -> None:
        r, seated = self._workers[t.dst].core.kv_arrived(t.key, True, self._now)
        current = self.placement.current(r.request_id, r.attempt)
        if current is not None and r.task is not None:
            self._drop(r.request_id, self.placement.kv_received(
                current, t.dst, seated, r.pages if seated else []))

    def _finish(self, live: _Live) -> None:
        req = live.request
        m = req.metrics
        self._records.append({
            "id": live.index, "arrival": m.arrival_time, "finish": m.finish_time,
            "latency": m.e2e_latency, "ttfb": m.time_to_first_block,
            "queueing": m.queueing_time, "decode": m.decode_time, "transfer": live.transfer_s,
            "forwards": m.num_steps, "prompt_len": req.prompt_len, "gen_len": live.gen_len,
            "canvas_tokens": live.blocks_to_decode * req.block_length,
            "threshold": (sum(live.thresholds.values()) / len(live.thresholds)
                          if live.thresholds else None),  # its blocks' mean: load-adaptive
        })
        del self._lives[req.request_id]


def simulate(config: SimConfig, trace: Sequence[TraceRequest], qps: float = math.nan,
             coefficients: Coefficients | None = None, steps: StepModel | None = None,
             geometry: tuple[ModelGeometry, int] | None = None) -> SimResult:
    return Simulator(config, coefficients, steps, geometry).run(trace, qps)

