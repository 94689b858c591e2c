"""Discrete-event simulation of a Sangam deployment: N workers, one central placement.

The policy objects are the engine's own (DESIGN.md §1): ``Placement`` decides where each block
runs, when K/V moves and what waits for memory, as it does for the multi-worker front; every
worker keeps its requests in a ``WorkerCore`` over a ``BatchBuilder`` and a ``PageAllocator``,
as a worker process does. Only the forward pass and the link are replaced: an iteration lasts
what the cost model (:mod:`sangam.bench.cost_model`) says for its batch composition, the tokens
each forward commits are drawn from a distribution (:class:`StepModel`, per request and
block), and a K/V transfer takes its whole pages' bytes over the link's bandwidth, one
transfer at a time per sender and per receiver.

Per iteration of a worker, as the worker process: ``schedule(now)``; the forward takes
``cost(batch)`` seconds; then, as the front reads the worker's report, the refreshes run
(``Placement.refreshed``), the K/V sent (``kv_sent``; the receiver expects it), and the blocks
that ended (``block_done``, after ``WorkerCore.step_done``). When K/V lands the receiver seats
the request (``kv_received``). Modes and placement are ``Placement``'s (DESIGN.md §4); see
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
from dataclasses import dataclass, replace

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
    kv_pool_pages,
)
from sangam.bench.sim.config import SimConfig
from sangam.bench.sim.steps import GeometricSteps, StepModel
from sangam.bench.traces import TraceRequest
from sangam.sampling_params import FULL_REFRESH, MAX_INT32, grid_canvas
from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import NeverFits, Placed, Placement
from sangam.sched.request import Request
from sangam.sched.worker_core import Task, WorkerCore


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
    forwards: int = 0  # as of the start of the current block
    transfer_s: float = 0.0  # exposed K/V transfer time, summed over blocks

    @property
    def request(self) -> Request:
        return self.placed.request


@dataclass
class _Progress:
    """A worker's copy of a request's block (the engine's DecodeState): placing a block
    starts it from the block's start, as the front's snapshot does; a K/V transfer carries
    the sender's copy to the receiver."""

    live: _Live
    step: int = 0  # forwards of the current block done
    forwards: int = 0

    def masks_left(self, plan: list[int]) -> int:
        return sum(plan[self.step:])  # the plan commits every mask of the block


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
        self.cost = CostModel(self.geom, coefficients or Coefficients.defaults(gpu), dtype_bytes)
        self.steps = steps or GeometricSteps()
        self.num_pages = config.num_pages or kv_pool_pages(
            self.geom, gpu, config.page_size, config.memory_fraction)
        self.link_bw = LINKS[config.link]

    # One run.
    def run(self, trace: Sequence[TraceRequest], qps: float = math.nan) -> SimResult:
        cfg = self.config
        budget = math.inf if cfg.policy == "prefill_first" else cfg.token_budget
        self._workers = []
        for i, role in enumerate(cfg.roles):  # as the engine builds each worker's parts
            self._workers.append(_Worker(i, role, WorkerCore(BatchBuilder(
                PageAllocator(self.num_pages), cfg.page_size, cfg.policy, budget,
                cfg.max_batch_size, cfg.drain_iterations, cfg.enable_chunked_prefill))))
        self._transfer_ids = itertools.count()
        self.placement = Placement(cfg.mode, cfg.roles, [self.num_pages] * len(cfg.roles),
                                   cfg.page_size, cfg.overflow_threshold, cfg.seed)
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
            canvas = grid_canvas(t.prompt_len, want, b)
            blocks = -(-(t.prompt_len + out) // b) - t.prompt_len // b
            req = Request(f"r{index}", t.arrival_time, t.prompt_len, canvas, b, cfg.cache,
                          refresh_interval=MAX_INT32, block_causal=True)
        else:
            canvas = -(-want // b) * b
            blocks = -(-out // b)
            req = Request(f"r{index}", t.arrival_time, t.prompt_len, canvas, b, cfg.cache,
                          refresh_interval=cfg.refresh_interval,
                          prompt_refresh_interval=cfg.prompt_refresh_interval)
        try:
            placed = self.placement.add(req)
        except NeverFits as e:
            raise ValueError(f"request {index} can never fit a worker's KV pool: {e}") from None
        self._lives[req.request_id] = _Live(index, placed, out, blocks)

    @staticmethod
    def _view(live: _Live) -> Request:
        """A worker's copy of the request, at its current block (as a worker builds one)."""
        r = live.request
        req = Request(r.request_id, r.arrival_time, r.prompt_len, r.canvas_len,
                      r.block_length, r.cache, seq=r.seq, refresh_interval=r.refresh_interval,
                      prompt_refresh_interval=r.prompt_refresh_interval,
                      block_causal=r.block_causal)
        req.block, req.force_refresh = r.block, r.force_refresh
        return req

    def _place(self) -> None:
        for d in self.placement.place():
            live = self._lives[d.request_id]
            self._workers[d.worker].core.take_block(Task(
                self._view(live), _Progress(live, 0, live.forwards), d.attempt, d.kv_dest,
                d.keep_pages))

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
            w.core.seat_ready()
            if not w.core.builder.has_work:
                continue
            batch = w.core.builder.schedule(now)
            if batch.is_empty:
                continue  # memory-blocked; a later event frees pages
            spans = [self._prefill_span(r) for r in batch.prefills]
            for r in batch.decodes:
                progress = w.core.tasks[r.request_id].payload
                kv = r.block_origin + (r.block + 1) * r.block_length if r.block_causal \
                    else r.total_len
                spans.append(Span(r.decode_span, kv,
                                  progress.masks_left(self.block_plan(progress.live)),
                                  r.block_length if r.block_causal else 0))
            dt = self.cost.iteration_time(spans)
            w.batch, w.started = batch, now
            w.iterations += 1
            w.busy_s += dt
            w.batch_sum += len(spans)
            w.prefill_tokens += batch.prefill_tokens
            self._push(now + dt, _ITER_DONE, w)

    @staticmethod
    def _prefill_span(r: Request) -> Span:
        """A refresh's part of the forward; block-causal, [prefilled, e) under the mask (a
        prefill chunk, [prefilled, chunk_end), scores no row)."""
        if not r.block_causal:
            return Span(r.prefill_cost, r.total_len, r.block_length)
        if r.chunk_end is not None:
            return Span(r.chunk_end - r.prefilled, r.chunk_end, 0, r.block_length)
        end = r.prefilled + r.prefill_cost
        return Span(r.prefill_cost, end, end - max(r.prompt_len, end - r.block_length),
                    r.block_length)

    def _iteration_done(self, w: _Worker) -> None:
        """In the worker's order: every request's step, then the reports (refreshes run, K/V
        sent, blocks done) as the front reads them."""
        now = self._now
        batch, w.batch = w.batch, None
        reqs = batch.decodes + batch.prefills
        tasks = [w.core.tasks[r.request_id] for r in reqs]
        chunks = {r.request_id for r in batch.prefills if r.chunk_end is not None}
        outcomes = [self._advance(t.payload, r.request_id in chunks) for r, t in zip(reqs, tasks)]
        for req, task in zip(batch.prefills, tasks[len(batch.decodes):]):
            if req.request_id in chunks:
                continue  # the refresh is not done: the rest of the prompt waits
            current = self.placement.current(req.request_id, task.attempt)
            if current is not None:
                self.placement.refreshed(current, w.index, w.started, now)
        for req, task, (block_done, finished, force) in zip(reqs, tasks, outcomes):
            goes_on = w.core.continues(req, block_done, finished, force)
            if task.kv_dest is not None and (not block_done or goes_on):
                self._ship(task, w, block_done)
        ended = []
        for req, (block_done, finished, force) in zip(reqs, outcomes):
            task, kept = w.core.step_done(req, now, block_done, finished, None, force)
            if block_done:
                ended.append((task, finished, kept, force))
        for task, finished, kept, force in ended:
            if kept is None:
                self._block_continued(task)
            else:
                self._block_done(task, w, finished, kept, force)

    def block_commits(self, request_id: str, block: int, block_length: int) -> list[int]:
        """The tokens each forward of a request's block commits: a function of (seed, request,
        block), so a block run again (after a drained transfer) commits the same, as the model
        would, whatever the order of events."""
        rng = random.Random(f"{self.config.seed}:{request_id}:{block}")
        return self.steps.block_commits(rng, block_length)

    def block_plan(self, live: _Live) -> list[int]:
        """``block_commits`` of the request's current block (drawn once): over its masks (a
        block-causal block 0 starts with the prompt's tail)."""
        r = live.request
        if live.plan[0] != r.block:
            masks = r.block_length
            if r.block_causal and r.block == 0:
                masks -= r.prompt_len - r.block_origin
            live.plan = (r.block, self.block_commits(r.request_id, r.block, masks))
        return live.plan[1]

    def _advance(self, progress: _Progress, chunk: bool = False) -> tuple[bool, bool, bool]:
        """One forward of a request's block (``chunk``: a block-causal prefill chunk, which
        commits nothing); returns (block done, request finished, next block refreshes fully
        by the adaptive trigger)."""
        live = progress.live
        if chunk:
            progress.forwards += 1
            return False, False, False
        progress.step += 1
        progress.forwards += 1
        block_done = progress.step == len(self.block_plan(live))
        finished = block_done and live.request.block + 1 == live.blocks_to_decode
        return block_done, finished, block_done and not finished and self._triggered(live)

    def _triggered(self, live: _Live) -> bool:
        """Whether the adaptive trigger refreshes the request's next block fully: drawn per
        (seed, request, block), so a block run again decides the same."""
        r, rate = live.request, self.config.adaptive_refresh_rate
        if not rate or r.block_refresh(r.block + 1) == FULL_REFRESH:
            return False
        return random.Random(f"{self.config.seed}:{r.request_id}:{r.block}:refresh").random() < rate

    def _block_done(self, task: Task, w: _Worker, finished: bool, kept: list[int],
                    force: bool = False) -> None:
        progress = task.payload
        live = progress.live
        current = self.placement.current(live.request.request_id, task.attempt)
        if current is None:
            return
        live.forwards = progress.forwards
        live.request.force_refresh = force  # placed as the full refresh it is
        block = live.request.block + (0 if finished else 1)
        self._drop(live.request.request_id, self.placement.block_done(
            current, w.index, finished, block, live.forwards, kept, self._now))
        if finished:
            self._finish(live)

    def _block_continued(self, task: Task) -> None:
        """The block ended and the next starts from cached K/V: it goes on here (or where this
        refresh's K/V went) without being placed, as the front's ``block_continued``."""
        progress = task.payload
        live = progress.live
        progress.step = 0
        current = self.placement.current(live.request.request_id, task.attempt)
        if current is None:
            return
        live.forwards = progress.forwards
        self.placement.block_continued(current, live.request.block + 1, live.forwards,
                                       self._now)

    # K/V transfers.
    def _ship(self, task: Task, p: _Worker, block_done: bool = False) -> None:
        """Send a refresh's K/V to ``task.kv_dest``, which takes it into its parked canvas or
        fresh pages, or drains it when it has no room (the block is then placed again). A
        refresh that ended its block (``block_done``) ships when the next block continues from
        its K/V: the receiver starts that block."""
        cfg, progress, now = self.config, task.payload, self._now
        live = progress.live
        rid = live.request.request_id
        current = self.placement.current(rid, task.attempt)
        drain = self.placement.kv_sent(current, p.index, task.kv_dest, drain=False)
        d = self._workers[task.kv_dest]
        key = (p.index, next(self._transfer_ids))
        seat = None
        if not drain:
            view = self._view(live)
            view.block += block_done
            seat = Task(view, replace(progress, step=0 if block_done else progress.step),
                        task.attempt, None, True, starts_block=block_done)
        d.core.expect_kv(key, rid, task.attempt, seat, live.placed.pages_needed)
        # Whole pages travel, as the engine sends them.
        xfer = self.cost.kv_bytes(len(task.request.pages) * cfg.page_size) / self.link_bw
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
        })
        del self._lives[req.request_id]


def simulate(config: SimConfig, trace: Sequence[TraceRequest], qps: float = math.nan,
             coefficients: Coefficients | None = None, steps: StepModel | None = None,
             geometry: tuple[ModelGeometry, int] | None = None) -> SimResult:
    return Simulator(config, coefficients, steps, geometry).run(trace, qps)

