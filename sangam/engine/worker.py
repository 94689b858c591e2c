"""A worker: one device's KV pool, batch builder and model runner, and the engine core's
iteration over them (docs/design.md §1).

The front tells it what to run (``Prefill``), what to receive (``ReceiveKV``) and what to forget
(``Drop``) through ``handle``; ``iterate`` runs one iteration (``WorkerCore``: schedule, the
forward, apply the outcomes) and collects what the front must hear (``events``, ``iterations``).
Time is its ``clock`` (the differential test runs it on a simulated one).
The same class serves in process (``Engine``: the front calls it directly) and in a worker
process (``engine/multi/worker.py`` wraps it with a control socket and a K/V transport).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sangam.config import EngineConfig
from sangam.decoding.state import DecodeState
from sangam.engine import messages as msg
from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.kv_pool import KVPool, pool_num_pages
from sangam.engine.loaded_model import LoadedModel, use_device
from sangam.engine.model_runner import ModelRunner
from sangam.engine.pool_layout import prefix_caching, window_ring
from sangam.engine.tensor_group import TensorGroup
from sangam.engine.worker_control import WorkerControl
from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.block_cursor import BlockCursor
from sangam.sched.prefix_cache import PrefixCache, extend_page_keys, request_page_keys
from sangam.sched.request import Request, StepOutcome
from sangam.sched.worker_core import BlockEnded, IterationStats, Ship, WorkerCore

logger = logging.getLogger(__name__)


def build_worker_parts(config: EngineConfig, loaded: LoadedModel,
                       group: TensorGroup | None = None
                       ) -> tuple[KVPool, BatchBuilder, ModelRunner]:
    """What every worker owns: its KV pool, its scheduler over that pool, its model runner.
    A rank of a tensor-parallel ``group`` holds its shard's pool (as many pages as the
    tightest rank's memory allows) and captures the same graphs as the others, in the same
    order (their all-reduces meet)."""
    use_device(loaded.device)  # the graphs are captured on this thread's current device
    spans = [s for _, s in graph_plan(config, loaded)] if captures_graphs(config, loaded) else ()
    ring = window_ring(config, loaded)
    num_pages = pool_num_pages(loaded, config, tuple(spans), ring)
    if group is not None:
        loaded.model.all_reduce = group.all_reduce
        num_pages = group.agree_min(num_pages)
    pool = KVPool(loaded.model.rank_config, num_pages, config.page_size,
                  loaded.dtype, loaded.device, fp8=config.kv_cache_dtype == "fp8", ring=ring,
                  seats=config.scheduler.batch_cap)
    cache = PrefixCache(pool.allocator) if prefix_caching(config, loaded) else None
    builder = BatchBuilder(pool.allocator, config.scheduler, cache, pool.rings)
    return pool, builder, ModelRunner(loaded, pool, graphs=decode_graphs(config, loaded, pool),
                                      group=group)


def graph_block_lengths(config: EngineConfig, loaded: LoadedModel) -> tuple[int, ...]:
    """The block lengths whose DualCache decode steps replay CUDA graphs: those of
    ``--cuda-graph-block-lengths``, else the one requests get by default (``default_params``:
    the checkpoint's, or ``--block-length``)."""
    return config.graph_block_lengths() or (loaded.default_params().block_length,)


def graph_plan(config: EngineConfig, loaded: LoadedModel) -> list[tuple[int, int]]:
    """(block length, span) of each decode graph runner: one per DualCache step span of each
    captured block length (``BlockCursor.graph_spans``); a uniform-state model's one, its
    canvas's later steps."""
    if loaded.config.gemma is not None:
        c = loaded.config.gemma.canvas_length
        return [(c, c)]
    causal = loaded.config.block_causal
    return [(b, span) for b in graph_block_lengths(config, loaded)
            for span in BlockCursor.graph_spans(b, causal)]


def captures_graphs(config: EngineConfig, loaded: LoadedModel) -> bool:
    """Whether decode steps get CUDA graphs: on a GPU, with the Triton backend (the reference
    backend reads host-side lengths), unless ``enforce_eager``."""
    return (not config.enforce_eager and loaded.device.type == "cuda"
            and loaded.model.attention_backend.name == "triton")


def decode_graphs(config: EngineConfig, loaded: LoadedModel,
                  pool: KVPool) -> list[DecodeGraphRunner]:
    """CUDA graphs for decode steps at ``graph_block_lengths``, when they can run
    (``captures_graphs``). Logs what was captured."""
    model = loaded.model
    if not captures_graphs(config, loaded):
        return []
    max_pages = -(-loaded.context_length // config.page_size)
    causal = loaded.config.block_causal
    runners = []
    for block, span in graph_plan(config, loaded):
        try:
            runners.append(DecodeGraphRunner(model, pool.kv, span, config.max_batch_size,
                                             max_pages, loaded.device,
                                             causal_block=block if causal else None,
                                             canvas=loaded.config.gemma is not None,
                                             rings=pool.rings is not None))
        except Exception as e:  # eager steps compute the same tokens: serve, and say why
            logger.warning("CUDA graph capture for block length %d (span %d) failed, so its "
                           "decode steps run eagerly (--enforce-eager skips the capture): %r",
                           block, span, e)
    logger.info("CUDA graphs for decode steps of block length %s (batch sizes up to %d)",
                ", ".join(f"{r.causal_block} (span {r.span})" if causal else str(r.span)
                          for r in runners) or "none", config.max_batch_size)
    return runners


def worker_control(config: EngineConfig, loaded: LoadedModel, pool: KVPool,
                   runner: ModelRunner, builder: BatchBuilder | None,
                   engine_rank: int = 0) -> WorkerControl:
    """A rank's side of weight updates, cache flushes and memory release (its prefix cache:
    ``builder``'s, None on a tensor-parallel follower, which caches nothing); its CUDA graphs
    are captured again when memory returns at other addresses."""
    def recapture() -> None:
        if runner.graphs:
            runner.graphs = decode_graphs(config, loaded, pool)

    return WorkerControl(loaded, pool, None if builder is None else builder.prefix_cache,
                         engine_rank, recapture)


def agree(group: TensorGroup, ok: bool) -> bool:
    """Whether every rank of ``group`` says the same ``ok`` (every rank calls this)."""
    return group.agree_min(int(ok)) == -group.agree_min(-int(ok))


def scheduling_request(m: msg.Prefill | msg.ReceiveKV, state: DecodeState,
                       page_size: int | None = None, **block: object) -> Request:
    """A worker's record of the request that ``m`` orders, run with ``state`` (its cursor; the
    front's arrival and place among equal arrivals, so that a worker orders them as the front
    does), with what ``block`` says of this block. With ``page_size`` (the worker caches
    prefixes), a block-causal request yet to store any of its prompt gets the keys of its
    prompt's pages."""
    p = state.params
    req = Request(m.request_id, m.arrival, state.cursor, priority=p.priority, seq=m.seq,
                  load_adaptive=p.min_threshold is not None, state=state, attempt=m.attempt,
                  **block)
    if page_size is not None:
        req.page_keys = request_page_keys(state.cursor, state.tokens, page_size)
    return req


def _block_progress(r: Request, block: int) -> msg.BlockProgress:
    return msg.block_progress(r.state, block)


class Worker:
    """The engine core's iteration around one worker's parts, in process: it runs whole blocks
    (colocated) and moves no K/V; ``engine/multi/worker.py``'s ``TransferWorker`` adds the K/V
    transport. A test may give a stand-in runner."""

    remote = False  # a worker process's reports carry copies of its requests' progress

    def __init__(self, index: int, builder: BatchBuilder, runner: ModelRunner,
                 streaming: bool = False, control: WorkerControl | None = None):
        self.index = index
        self.builder = builder
        self.runner = runner
        self.control = control  # weight updates, cache flushes, memory (None: a stand-in)
        self.core = WorkerCore(builder, streaming)  # tasks, seats, parked canvases, receives
        self.clock: Callable[[], float] = time.monotonic
        self.events: list[msg.Event] = []
        self.iterations: list[IterationStats] = []

    # Control messages.
    def handle(self, m: object) -> None:
        if isinstance(m, msg.Prefill):
            state = self.core.parked_state(m.request_id) if m.state is None else m.state
            cached = self.builder.prefix_cache is not None
            self.core.take_block(scheduling_request(
                m, state, self.builder.page_size if cached else None, kv_dest=m.kv_dest,
                keep_pages=m.keep_pages, stays=m.stays))
        elif isinstance(m, msg.Drop):
            self.core.drop(m.request_id)
        elif isinstance(m, msg.Control):
            self.events.append(msg.ControlDone(m.ticket, self.run_control(m)))
        else:
            raise TypeError(f"worker {self.index}: unexpected message {m!r}")

    def run_control(self, m: msg.Control) -> str | None:
        """Run ``m`` on every rank of this worker; None, or why it was refused (every rank
        unchanged). Ranks that disagree (one applied it, another not) leave the worker
        inconsistent: that raises, and the worker ends."""
        group = self.runner.group
        if group is not None:
            group.send(("control", m))
        try:
            self.control.run(m)
            error = None
        except Exception as e:
            logger.warning("worker %d: %s refused: %s", self.index, m.op, e)
            error = str(e)
        if group is not None and not agree(group, error is None):
            raise RuntimeError(f"worker {self.index}: the ranks of its tensor-parallel group "
                               f"disagree on {m.op}: their weights may differ")
        return error

    # One iteration.
    def iterate(self) -> bool:
        """Schedule and run one iteration; False when there was nothing to run now."""
        start = self.clock()
        batch = self.core.schedule(start)
        if batch is None:
            return False
        self.run(batch, start)
        return True

    def run(self, batch: ScheduledBatch, start: float) -> None:
        """The batch's forward (scheduled at ``start``), then its outcomes and reports."""
        reqs = batch.requests
        states = [r.state for r in reqs]
        if self.builder.num_load_adaptive:  # those starting a block take the load's threshold
            load = self.builder.load
            for st in states:
                if st.params.min_threshold is not None:
                    st.set_load(load)
        outcomes = self._execute(reqs, states, [r.pages for r in reqs])
        end = self.clock()
        out = self.core.complete(batch, outcomes, start, end)
        self.events += out.refresh_reports(end - start)
        for ship in out.ships:
            self._ship(ship)
        for ev in out.ended:
            r = ev.request
            if isinstance(ev, BlockEnded) and r.page_keys is not None and not ev.finished:
                # The next block's first step makes the finished ones final: their keys join.
                extend_page_keys(r.page_keys, r.state.tokens, r.cursor.block_bounds()[0],
                                 self.builder.page_size, r.cursor.key_block)
        self.events += out.end_reports(_block_progress if self.remote else None)
        for r, st in zip(reqs, states):
            if st.draft is not None:  # a step of a request that streams drafts
                self.events.append(msg.Draft(r.request_id, r.attempt, r.cursor.block,
                                             st.draft.tolist()))
                st.draft = None
        self.iterations.append(out.stats)

    def _execute(self, reqs: list[Request], states: list[DecodeState],
                 pages: list[list[int]]) -> list[StepOutcome]:
        """The forward (``TransferWorker`` streams refreshes' K/V out during it)."""
        return self.runner.execute(states, pages, rings=self._rings(reqs))

    def _rings(self, reqs: list[Request]) -> list[list[int]] | None:
        """The requests' rings under a hybrid pool (``KVPool.rings``); None: one pool."""
        return [r.window_pages for r in reqs] if self.builder.rings is not None else None

    def _ship(self, ship: Ship) -> None:
        raise RuntimeError(f"worker {self.index} moves no K/V: it cannot ship "
                           f"{ship.request.request_id!r}")
