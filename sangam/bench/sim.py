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

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import os
import random
import sys
from collections.abc import Callable, Sequence
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
    load_calibrated_geometry,
)
from sangam.bench.report import (
    SUMMARY_COLUMNS,
    format_table,
    parse_float_list,
    parse_overrides,
    plot_latency,
    summarize,
    write_outputs,
)
from sangam.bench.traces import (
    LengthSample,
    TraceRequest,
    arrivals,
    build_trace,
    load_lengths,
    scale_lengths,
)
from sangam.config import EngineConfig
from sangam.sampling_params import (
    CACHE_MODES,
    FULL_REFRESH,
    MAX_INT32,
    SamplingParams,
    grid_canvas,
)
from sangam.sched.batch_builder import POLICIES, BatchBuilder, ScheduledBatch
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.placement import NeverFits, Placed, Placement
from sangam.sched.request import Request
from sangam.sched.router import MODES
from sangam.sched.worker_core import Task, WorkerCore

# The deployment options the simulator shares with the engine take the engine's defaults.
_ENGINE = {f.name: f for f in dataclasses.fields(EngineConfig)}
_REQUEST = SamplingParams()


# Tokens committed per forward.
class StepModel:
    """How many positions each forward of a block commits (a refresh is the first step)."""

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class GeometricSteps(StepModel):
    """Each step commits k >= 1 tokens, k geometric with mean ``mean`` (the default 3.25 is
    Fast-dLLM's threshold 0.9 on LLaDA), the last step of a block what is left."""

    mean: float = 3.25

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"mean tokens per step must be >= 1, got {self.mean}")

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        out = []
        left = block_length
        p = 1.0 / self.mean
        log_q = math.log1p(-p) if p < 1 else -math.inf
        while left > 0:
            # Inverse CDF of the geometric distribution on {1, 2, ...}.
            k = 1 if p >= 1 else 1 + int(math.log(1.0 - rng.random()) / log_q)
            out.append(min(k, left))
            left -= out[-1]
        return out

    def describe(self) -> str:
        return f"geometric, mean {self.mean} tokens/step"


@dataclass(frozen=True)
class FixedSteps(StepModel):
    """Exactly ``tokens`` per step (the last step of a block: the rest)."""

    tokens: int

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        full, rest = divmod(block_length, self.tokens)
        return [self.tokens] * full + ([rest] if rest else [])

    def describe(self) -> str:
        return f"fixed {self.tokens} tokens/step"


@dataclass(frozen=True)
class ProfileSteps(StepModel):
    """Forwards per block drawn from a measured histogram (``sangam-bench serve`` writes one),
    the block's positions split evenly over them."""

    steps_per_block: dict[int, int]  # forwards per block -> how many blocks took that many

    def __post_init__(self) -> None:
        if not self.steps_per_block or any(k < 1 or c < 0 for k, c in
                                           self.steps_per_block.items()):
            raise ValueError("steps_per_block needs positive step counts")

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        k = rng.choices(list(self.steps_per_block), list(self.steps_per_block.values()))[0]
        k = min(k, block_length)
        base, extra = divmod(block_length, k)
        return [base + (i < extra) for i in range(k)]

    def describe(self) -> str:
        n = sum(self.steps_per_block.values())
        mean = sum(k * c for k, c in self.steps_per_block.items()) / n
        return f"profile, mean {mean:.2f} forwards/block over {n} blocks"


def load_step_profile(path: str, block_length: int | None = None) -> ProfileSteps:
    """A ``profile.json`` of ``sangam-bench serve``; it must have been recorded at
    ``block_length`` when one is given (forwards per block depend on it)."""
    with open(path) as f:
        data = json.load(f)
    hist = data.get("steps_per_block")
    if not isinstance(hist, dict):
        raise ValueError(f"{path}: no 'steps_per_block' histogram")
    recorded = data.get("block_length")
    if block_length is not None and recorded is not None and recorded != block_length:
        raise ValueError(f"{path} was recorded at block length {recorded}, not {block_length}")
    return ProfileSteps({int(k): int(v) for k, v in hist.items()})


# Configuration.
@dataclass(frozen=True)
class SimConfig:
    model: str = "llada"  # key of cost_model.MODELS, or CALIBRATED
    gpu: str = "h100"  # key of cost_model.GPUS
    mode: str = "colocated"
    num_workers: int = 1  # colocated
    prefill_workers: int = 5  # disaggregated / hybrid
    decode_workers: int = 3
    policy: str = _ENGINE["policy"].default
    token_budget: float = _ENGINE["token_budget"].default
    drain_iterations: int = _ENGINE["drain_iterations"].default
    enable_chunked_prefill: bool = _ENGINE["enable_chunked_prefill"].default
    max_batch_size: int = _ENGINE["max_batch_size"].default
    overflow_threshold: int = _ENGINE["overflow_threshold"].default
    block_length: int = _REQUEST.block_length
    cache: str = _REQUEST.cache
    refresh_interval: int = _REQUEST.refresh_interval
    prompt_refresh_interval: int = _REQUEST.prompt_refresh_interval
    # Adaptive refresh (SamplingParams.refresh_confidence) has no confidences to read here: the
    # share of the blocks the cadence starts from cache that refresh fully anyway, drawn per
    # (seed, request, block); sangam-bench quality measures it for a refresh_confidence.
    adaptive_refresh_rate: float = 0.0
    max_tokens: int | None = None  # fixed canvas; None: each request's output length
    page_size: int = _ENGINE["page_size"].default
    num_pages: int | None = None  # per worker; None: what the GPU has left after the weights
    memory_fraction: float = _ENGINE["gpu_memory_fraction"].default
    link: str = "nvlink"
    layerwise_kv_streaming: bool = _ENGINE["layerwise_kv_streaming"].default
    seed: int = _ENGINE["seed"].default

    def __post_init__(self) -> None:
        if self.model not in (*MODELS, CALIBRATED):
            raise ValueError(f"model must be one of {[*sorted(MODELS), CALIBRATED]}, got "
                             f"{self.model!r}")
        if self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {self.gpu!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {sorted(LINKS)}, got {self.link!r}")
        if self.policy == "fastdllm" and self.mode != "colocated":
            raise ValueError("the fastdllm policy (batch size 1) runs colocated only")
        if self.block_causal and (self.mode != "colocated" or self.cache != "dual"
                                  or (self.refresh_interval, self.prompt_refresh_interval)
                                  != (1, 1) or self.adaptive_refresh_rate):
            raise ValueError("a block-causal model (sdar) runs colocated with cache 'dual' and "
                             "no refresh cadence, as the engine serves it")
        if min(self.num_workers, self.prefill_workers, self.decode_workers) < 1:
            raise ValueError("worker counts must be >= 1")
        if not 0.0 <= self.adaptive_refresh_rate <= 1.0:
            raise ValueError(f"adaptive_refresh_rate must be in [0, 1], got "
                             f"{self.adaptive_refresh_rate}")
        # The request-side checks are SamplingParams' own (cadence needs a cache, bounds).
        SamplingParams(block_length=self.block_length, cache=self.cache,
                       refresh_interval=self.refresh_interval,
                       prompt_refresh_interval=self.prompt_refresh_interval)

    @property
    def block_causal(self) -> bool:
        return self.model in MODELS and MODELS[self.model].block_causal

    @property
    def roles(self) -> list[str]:
        if self.mode == "colocated":
            return ["colocated"] * self.num_workers
        return ["prefill"] * self.prefill_workers + ["decode"] * self.decode_workers

    @property
    def label(self) -> str:
        if self.policy == "fastdllm":
            core = "fastdllm"
        elif self.policy == "adaptive":
            core = f"adaptive tau>={int(self.token_budget)}/{self.drain_iterations}"
        elif self.policy == "prefill_first" or math.isinf(self.token_budget):
            core = "prefill-first"
        else:
            core = f"tau={int(self.token_budget)}"
        if self.mode == "colocated":
            where = f"{self.num_workers}C"
        else:
            where = f"{self.prefill_workers}P{self.decode_workers}" + (
                "D" if self.mode == "disaggregated" else "C")
        cadence = ""
        if (self.refresh_interval, self.prompt_refresh_interval) != (1, 1):
            cadence = f" refresh={self.refresh_interval}/{self.prompt_refresh_interval}"
        if self.adaptive_refresh_rate:
            cadence += f" adaptive={self.adaptive_refresh_rate:g}"
        if self.enable_chunked_prefill and self.block_causal:
            cadence += " chunked"
        return f"{where} {core}" + (" lw" if self.layerwise_kv_streaming else "") + cadence


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


# Command line.
_HELP = {
    "model": "model geometry (DESIGN.md §6): llada = LLaDA-8B, dream = Dream-7B, sdar = "
             "SDAR-8B, sdar-4b, sdar-1.7b (block-causal: one prefill per request, colocated), "
             "calibrated = the model a --calibration file was measured on (e.g. a "
             "CPU-calibrated small one)",
    "gpu": "GPU of every worker: peak FLOP/s, HBM bandwidth and memory",
    "mode": "colocated, disaggregated (xPyD) or hybrid (xPyD + overflow onto decode workers)",
    "num_workers": "workers (GPUs) in colocated mode",
    "prefill_workers": "prefill workers in disaggregated / hybrid mode",
    "decode_workers": "decode workers in disaggregated / hybrid mode",
    "policy": "scheduling policy of every worker",
    "token_budget": "deficit token budget tau per iteration ('inf' = prefill-first; adaptive: "
                    "its floor)",
    "drain_iterations": "adaptive policy: tau admits the queue's share of the waiting prefill "
                        "tokens over this many iterations",
    "enable_chunked_prefill": "block-causal models (sdar): admit a prompt's prefill in chunks "
                              "of whole blocks within tau",
    "max_batch_size": "most requests in one forward",
    "overflow_threshold": "hybrid: outstanding prefill tokens (theta) on every prefill worker "
                          "before a prefill overflows onto a decode worker",
    "block_length": "block length B",
    "cache": "dual (span = block), prefix (span = block + rest of canvas) or none (refresh "
             "every step)",
    "refresh_interval": "blocks start with a refresh only every this many (the others with a "
                        "cached step)",
    "prompt_refresh_interval": "every this-many-th refresh is full, the others response-only "
                               "(span [P, T), cost T - P)",
    "adaptive_refresh_rate": "adaptive refresh: the share of blocks the cadence starts from "
                             "cache that refresh fully anyway (sangam-bench quality measures "
                             "it for a refresh_confidence)",
    "max_tokens": "fixed max_tokens of every request (canvas size); default: its output length",
    "page_size": "KV page size in tokens",
    "num_pages": "KV pages per worker; default: GPU memory left after the weights",
    "memory_fraction": "fraction of GPU memory for weights + KV pool",
    "link": "K/V transfer link: nvlink 450 GB/s, pcie 50 GB/s, network 25 GB/s",
    "layerwise_kv_streaming": "send layer l's K/V while layer l+1 computes",
    "seed": "seed of router tie-breaks and of the tokens committed per step",
}
_CHOICES = {"model": [*sorted(MODELS), CALIBRATED], "gpu": sorted(GPUS), "mode": MODES,
            "link": sorted(LINKS), "policy": POLICIES, "cache": CACHE_MODES}


def add_sim_args(p: argparse.ArgumentParser, for_capacity: bool = False) -> None:
    g = p.add_argument_group("deployment (one configuration; --compare adds more)")
    for f in dataclasses.fields(SimConfig):
        kind = str(f.type)
        kw: dict = {"help": _HELP[f.name], "default": f.default}
        if kind == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("float"):
            kw["type"] = float
        elif kind.startswith("int"):
            kw["type"] = int
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, **kw)
    g.add_argument("--compare", nargs="+", default=None, metavar="SPEC",
                   help="configurations to compare side by side, each a comma-separated list "
                        "of overrides of the flags above, e.g. 'policy=fastdllm' "
                        "'mode=hybrid,prefill_workers=5,decode_workers=3'")
    g.add_argument("--policies", default=None,
                   help="shorthand for --compare policy=A policy=B ...: comma-separated")
    g.add_argument("--token-budgets", default=None,
                   help="shorthand for --compare token_budget=A ...: comma-separated")
    g.add_argument("--calibration", default=None,
                   help="JSON of measured cost coefficients (sangam-bench calibrate)")
    t = p.add_argument_group("workload")
    t.add_argument("--trace", default="sharegpt",
                   help="sharegpt or arxiv (seeded synthetic), or a ShareGPT .json / .csv file")
    t.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default {DEFAULT_NUM_REQUESTS}; experiments have "
                        "their own)")
    t.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    t.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    t.add_argument("--trace-seed", type=int, default=0, help="seed of lengths and arrivals")
    t.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply every prompt and output length (as sangam-bench serve's)")
    t.add_argument("--tokens-per-step", type=float, default=3.25,
                   help="mean tokens committed per forward (geometric)")
    t.add_argument("--step-profile", default=None,
                   help="forwards-per-block histogram recorded by sangam-bench serve "
                        "(profile.json); replaces --tokens-per-step")
    if not for_capacity:
        t.add_argument("--qps", default=None,
                       help="offered load(s), comma-separated ('inf': all at once); default 1, "
                            "experiments have their own grids")
        p.add_argument("--out", default=None,
                       help="directory for results.json, summary.csv, requests.csv and the plot")
        p.add_argument("--against", default=None, metavar="SERVE_DIR",
                       help="the --out directory of a sangam-bench serve run on the same trace "
                            "flags: print simulated / measured latency per policy and QPS")
        p.add_argument("--experiment", default=None, choices=sorted(EXPERIMENT_NAMES),
                       help="run one of the paper's experiments, or refresh-cadence / "
                            "adaptive-tau / block-causal (of the deployment flags it takes "
                            "--gpu, --link, --layerwise-kv-streaming, --calibration and "
                            "--seed, and refresh-cadence --adaptive-refresh-rate; "
                            "--num-requests and --qps "
                            "replace its defaults)")


EXPERIMENT_NAMES = ("fastdllm-vs-deficit", "tau-sweep", "modes", "refresh-cadence",
                    "adaptive-tau", "block-causal")
# (sangam.bench.experiments)
DEFAULT_NUM_REQUESTS = 300


def configs_from_args(args: argparse.Namespace) -> dict[str, SimConfig]:
    """Label -> configuration: the flags, with each --compare spec applied on top."""
    base = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    specs = list(args.compare or [])
    policies = args.policies.split(",") if args.policies else [None]
    budgets = args.token_budgets.split(",") if args.token_budgets else [None]
    for pol, tau in itertools.product(policies, budgets):
        parts = ([f"policy={pol}"] if pol else []) + ([f"token_budget={tau}"] if tau else [])
        if parts:
            specs.append(",".join(parts))
    configs = [(s, replace(base, **parse_overrides(s, SimConfig))) for s in specs or [""]]
    labels = [c.label for _, c in configs]
    return {(c.label if labels.count(c.label) == 1 else f"{c.label} [{s}]"): c
            for s, c in configs}


def step_model_from_args(args: argparse.Namespace) -> StepModel:
    if args.step_profile:
        return load_step_profile(args.step_profile, args.block_length)
    return GeometricSteps(args.tokens_per_step)


def coefficients_from_args(args: argparse.Namespace, config: SimConfig) -> Coefficients:
    if args.calibration:
        return Coefficients.load(args.calibration)
    return Coefficients.defaults(GPUS[config.gpu])


def geometry_from_args(args: argparse.Namespace, config: SimConfig
                       ) -> tuple[ModelGeometry, int] | None:
    if config.model != CALIBRATED:
        return None
    if not args.calibration:
        raise ValueError("--model calibrated needs --calibration")
    return load_calibrated_geometry(args.calibration)


def make_trace(lengths: Sequence[LengthSample], qps: float, args: argparse.Namespace
               ) -> list[TraceRequest]:
    times = arrivals(len(lengths), qps, args.trace_seed + 1, args.arrival, args.cv)
    return build_trace(lengths, times)


def run_point(config: SimConfig, lengths: Sequence[LengthSample], qps: float,
              args: argparse.Namespace, label: str) -> tuple[dict, SimResult]:
    """One simulated run; its summary carries ``config`` (the label) and utilization."""
    res = simulate(config, make_trace(lengths, qps, args), qps,
                   coefficients_from_args(args, config), step_model_from_args(args),
                   geometry_from_args(args, config))
    summary = {"config": label, **summarize(res.records, qps)}
    summary["utilization"] = sum(w["utilization"] for w in res.workers) / len(res.workers)
    return summary, res


def trace_lengths(args: argparse.Namespace) -> list[LengthSample]:
    return scale_lengths(load_lengths(args.trace, args.num_requests or DEFAULT_NUM_REQUESTS,
                                      args.trace_seed), args.length_scale)


def config_labels(args: argparse.Namespace) -> list[str]:
    return list(configs_from_args(args))


def capacity_probe(args: argparse.Namespace) -> Callable[[float, str], dict]:
    """For ``sangam-bench capacity``: (qps, label) -> summary of one simulated run."""
    configs = configs_from_args(args)
    lengths = trace_lengths(args)

    def probe(qps: float, label: str) -> dict:
        return run_point(configs[label], lengths, qps, args, label)[0]

    return probe


def run(args: argparse.Namespace) -> int:
    if args.experiment:
        from sangam.bench.experiments import run_experiment

        return run_experiment(args.experiment, args)
    try:  # the user's inputs, checked before any run: a clear message instead of a traceback
        configs = configs_from_args(args)
        qps_list = parse_float_list(args.qps or "1")
        lengths = trace_lengths(args)
        steps = step_model_from_args(args)
        first = next(iter(configs.values()))
        coefficients_from_args(args, first)
        geometry = geometry_from_args(args, first)
        model_name = geometry[0].name if geometry else MODELS[first.model].name
        if args.against:
            from sangam.bench.validation import load_measured

            load_measured(args.against)
    except (ValueError, OSError) as e:
        raise SystemExit(f"sangam-bench sim: {e}") from e
    summaries, records = [], []
    print(f"trace {args.trace}: {len(lengths)} requests, {args.arrival} arrivals; "
          f"{steps.describe()}", file=sys.stderr)
    for label, cfg in configs.items():
        for qps in qps_list:
            summary, res = run_point(cfg, lengths, qps, args, label)
            print(f"  {label} @ {qps:g} QPS: mean {summary['latency_mean']:.2f} s", file=sys.stderr)
            summaries.append(summary)
            records += [{"config": label, "qps": qps, **r} for r in res.records]
    print(format_table(summaries, SUMMARY_COLUMNS + (("utilization", "util", "{:.2f}"),)))
    against = None
    if args.against:
        from sangam.bench import validation

        against = validation.compare(summaries, records, configs, args.against)
        print(f"\nsimulated against measured ({args.against}):")
        print(validation.format_rows(against))
    if args.out:
        report = {"kind": "sim", "trace": args.trace, "num_requests": len(lengths),
                  "length_scale": args.length_scale, "configs": configs,
                  "summaries": summaries, "against": against}
        paths = write_outputs(args.out, report, summaries, records)
        by_config: dict[str, list[dict]] = {}
        for s in summaries:
            by_config.setdefault(s["config"], []).append(s)
        paths += plot_latency(
            os.path.join(args.out, "latency_vs_qps.png"),
            {f"{model_name}, {args.trace}": by_config})
        print("wrote " + ", ".join(paths))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sim", help="discrete-event simulation of a multi-GPU deployment",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_args(p)
    p.set_defaults(func=run)
