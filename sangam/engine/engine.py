"""The engine loop of one worker: schedule, run one packed forward, advance requests.

``Engine.step()`` is one iteration. The BatchBuilder decides who runs (DESIGN.md §4), the
ModelRunner runs them, and each request's DecodeState says whether its block ended; requests
then go back to the builder (seated decode, waiting for the next block's re-prefill, or done).
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine.cuda_graphs import DecodeGraphRunner
from sangam.engine.kv_pool import KVPool, pool_num_pages
from sangam.engine.loaded_model import LoadedModel, use_device
from sangam.engine.model_runner import ModelRunner
from sangam.sampling_params import MAX_INT32, RequestOutput, SamplingParams
from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.request import Request, RequestMetrics

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long for the pool, queue full...)."""


class QueueFull(RequestRejected):
    """Overload: more requests in flight than ``max_queue_len``; retry later."""


@dataclass
class IterationStats:
    prefill_tokens: int
    decode_tokens: int
    deficit: int
    batch_size: int
    num_prefills: int
    seconds: float


@dataclass
class _Tracked:
    request: Request
    state: DecodeState
    prompt_ids: list[int]
    arrival: float
    outputs: int = 0  # blocks already reported
    text: IncrementalDetokenizer = field(init=False)  # the outputs' text

    def __post_init__(self) -> None:
        self.text = IncrementalDetokenizer(self.state.params.skip_special_tokens)


@dataclass
class EngineStats:
    iterations: deque = field(default_factory=lambda: deque(maxlen=10_000))
    finished: deque = field(default_factory=lambda: deque(maxlen=10_000))  # per-request metrics


def build_worker_parts(config: EngineConfig,
                       loaded: LoadedModel) -> tuple[KVPool, BatchBuilder, ModelRunner]:
    """What every worker owns: its KV pool, its scheduler over that pool, its model runner."""
    use_device(loaded.device)  # the graphs are captured on this thread's current device
    num_pages = pool_num_pages(loaded.config, config, loaded.dtype, loaded.device)
    pool = KVPool(loaded.config, num_pages, config.page_size, loaded.dtype, loaded.device)
    builder = BatchBuilder(pool.allocator, config.page_size, config.policy,
                           config.effective_token_budget, config.max_batch_size,
                           config.drain_iterations, config.enable_chunked_prefill)
    return pool, builder, ModelRunner(loaded, pool, graphs=decode_graphs(config, loaded, pool))


def graph_block_lengths(config: EngineConfig, loaded: LoadedModel) -> tuple[int, ...]:
    """The block lengths whose DualCache decode steps replay CUDA graphs: those of
    ``--cuda-graph-block-lengths``, else the one requests get by default (``default_params``:
    the checkpoint's, or ``--block-length``)."""
    return config.graph_block_lengths() or (loaded.default_params().block_length,)


def decode_graphs(config: EngineConfig, loaded: LoadedModel,
                  pool: KVPool) -> list[DecodeGraphRunner]:
    """CUDA graphs for decode steps at ``graph_block_lengths``, when they can run: on a GPU,
    with the Triton backend (the reference backend reads host-side lengths), unless
    ``enforce_eager``. Logs what was captured."""
    model = loaded.model
    if (config.enforce_eager or loaded.device.type != "cuda"
            or model.attention_backend.name != "triton"):
        return []
    max_pages = -(-loaded.context_length // config.page_size)
    runners = []
    for span in graph_block_lengths(config, loaded):
        try:
            runners.append(DecodeGraphRunner(model, pool.kv, span, config.max_batch_size,
                                             max_pages, loaded.device))
        except Exception as e:  # eager steps compute the same tokens: serve, and say why
            logger.warning("CUDA graph capture for block length %d failed, so its decode "
                           "steps run eagerly (--enforce-eager skips the capture): %r", span, e)
    logger.info("CUDA graphs for decode steps of block length %s (batch sizes up to %d)",
                ", ".join(str(r.span) for r in runners) or "none", config.max_batch_size)
    return runners


def new_request(in_flight: Mapping[str, object], config: EngineConfig, loaded: LoadedModel,
                rng: random.Random, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, arrival_time: float | None,
                suffix_token_ids: list[int] = ()) -> tuple[Request, DecodeState]:
    """The checks every engine makes at submission, then the request's scheduling object and
    its canvas. Raises (RequestRejected, QueueFull, ValueError) without side effects."""
    if request_id in in_flight:
        raise ValueError(f"request id {request_id!r} is already in use")
    if params.n != 1:
        raise ValueError(f"n={params.n}: a request is one sequence; submit n requests (as "
                         "LLM.generate and the server do)")
    if len(in_flight) >= config.max_queue_len:
        raise QueueFull(f"{len(in_flight)} requests in flight (max_queue_len "
                        f"{config.max_queue_len})")
    state = loaded.new_state(prompt_token_ids, params, rng, suffix_token_ids)
    now = time.monotonic() if arrival_time is None else arrival_time
    return scheduling_request(request_id, now, state), state


def start_blocks_at(load: float, states: list[DecodeState]) -> None:
    """The batch's requests that start a block take their load-adaptive threshold from the
    worker's ``load`` now (before the forward)."""
    for st in states:
        if st.params.min_threshold is not None:
            st.set_load(load)


def request_error(error: BaseException) -> str:
    """What a failed request's caller is told."""
    return f"the request failed in the engine: {error!r}"


def scheduling_request(request_id: str, arrival_time: float, state: DecodeState,
                       seq: int | None = None) -> Request:
    """The scheduler's view of a request whose canvas is ``state``, at its current block
    (``seq``: the front's request's, so that a worker orders equal arrivals as it does)."""
    p = state.params
    # A block-causal request refreshes only its first block (its cadence: never again).
    refresh_interval = MAX_INT32 if state.block_causal else p.refresh_interval
    req = Request(request_id, arrival_time, state.prompt_len,
                  state.canvas_end - state.prompt_len, p.block_length, p.cache,
                  state.total_len - state.canvas_end, p.priority, seq, refresh_interval,
                  p.prompt_refresh_interval, p.min_threshold is not None, state.block_causal)
    req.block = state.block
    return req


def request_metrics(m: RequestMetrics, state: DecodeState) -> dict:
    """Per-request latency breakdown (seconds) and parallelism, as reported to users."""
    return {
        "arrival_time": m.arrival_time,
        "e2e_latency": m.e2e_latency,
        "time_to_first_block": m.time_to_first_block,
        "queueing_time": m.queueing_time,
        "decode_time": m.decode_time,
        "num_forwards": state.num_forwards,
        "num_refreshes": len(m.prefill_started),  # full and response-only, so far
        "tokens_per_forward": tokens_per_forward(state),
    }


def tokens_per_forward(state: DecodeState) -> float:
    """Canvas tokens committed per forward spent: the parallelism diffusion decoding got."""
    committed = int((state.tokens[state.prompt_len:state.canvas_end] != state.mask_token_id).sum())
    return committed / max(1, state.num_forwards)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.loaded = loaded or LoadedModel.load(config)
        self.pool, self.builder, self.runner = build_worker_parts(config, self.loaded)
        self.requests: dict[str, _Tracked] = {}
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)

    # Requests in and out.
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    suffix_token_ids: list[int] = ()) -> None:
        """Validate and queue a request (with ``suffix_token_ids``: an infill between prompt
        and suffix); raises (and changes nothing) if it cannot be served."""
        req, state = new_request(self.requests, self.config, self.loaded, self._rng, request_id,
                                 prompt_token_ids, params, arrival_time, suffix_token_ids)
        now = req.arrival_time
        if not self.builder.fits_ever(req):
            raise RequestRejected(
                f"request needs {self.pool.pages_for(state.total_len)} KV pages for "
                f"{state.total_len} tokens, more than the pool's {self.pool.num_pages}")
        self.requests[request_id] = _Tracked(req, state, state.prompt_ids(), now)
        self.builder.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return None
        self.builder.abort(request_id)
        return self._output(tracked, finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def shutdown(self) -> None:
        """Nothing to stop in process (the multi-worker engine stops its workers here)."""

    # One iteration.
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that completed a block."""
        use_device(self.loaded.device)  # whichever thread steps (an AsyncEngine's, a user's)
        start = time.monotonic()
        batch = self.builder.schedule(start)
        if batch.is_empty:
            return []
        reqs = batch.decodes + batch.prefills
        tracked = [self.requests[r.request_id] for r in reqs]
        states = [t.state for t in tracked]
        for r, t in zip(batch.prefills, tracked[len(batch.decodes):]):
            t.state.chunk_end = r.chunk_end  # a block-causal prefill chunk, or None
        if self.builder.num_load_adaptive:
            start_blocks_at(self.builder.load, states)
        result = self.runner.execute(states, [r.pages for r in reqs])
        now = time.monotonic()
        outputs = [self._fail(tracked[i], e) for i, e in result.errors.items()]
        for req, t, done in zip(reqs, tracked, result.block_done):
            if t.request.request_id not in self.requests:
                continue  # failed
            finished = t.state.finished
            self.builder.step_done(req, now, done, finished, t.state.finish_reason,
                                   t.state.force_refresh)
            if done:
                outputs.append(self._output(t, finished, t.state.finish_reason))
            if finished:
                del self.requests[req.request_id]
                self.stats.finished.append(req.metrics)
        self._record(batch, now - start)
        return outputs

    def _fail(self, t: _Tracked, error: Exception) -> RequestOutput:
        """End a request whose step failed: its pages are freed, its caller gets the error."""
        rid = t.request.request_id
        logger.error("request %s failed and was ended: %r", rid, error)
        del self.requests[rid]
        self.builder.abort(rid)
        return self._output(t, finished=True, reason="error", error=request_error(error))

    def _record(self, batch: ScheduledBatch, seconds: float) -> None:
        self.stats.iterations.append(IterationStats(
            batch.prefill_tokens, batch.decode_tokens, batch.deficit,
            len(batch.prefills) + len(batch.decodes), len(batch.prefills), seconds))

    def _output(self, t: _Tracked, finished: bool, reason: str | None,
                error: str | None = None) -> RequestOutput:
        return self.loaded.output(t.request.request_id, t.prompt_ids, t.state, finished, reason,
                                  request_metrics(t.request.metrics, t.state), t.text, error)
