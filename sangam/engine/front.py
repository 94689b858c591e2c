"""The front of an engine (docs/design.md §1, §4): the request table and ``Placement`` (where
each block runs, when K/V moves, what a failure takes back) are the policy core's
``FrontCore``; this adds its transport's side (orders out, reports in), the requests' decode
states and the outputs made from what the workers report.

It never touches the model. Per request it keeps a ``DecodeState``: in process the very state
its worker runs, across processes a copy kept at the start of the request's next block (a
token array: all that recovery needs, because a block's refresh recomputes every layer's K/V
from the tokens alone), caught up from the block reports. ``Engine`` (engine.py) is a front over
one in-process worker; ``MultiWorkerEngine`` (multi/front.py) a front over worker processes.
Both speak to their workers in the same messages (``sched/messages.py``) and hear the same
reports; time is the front's ``clock`` (the differential test runs it on a simulated one).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine import messages as msg
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.outputs import request_output
from sangam.engine.pool_layout import prefix_caching
from sangam.engine.validation import new_state
from sangam.engine.weight_group import check_group
from sangam.engine.worker_control import MEMORY_TAGS
from sangam.models.weight_update import (
    check_same_model,
    check_update,
    checkpoint_specs,
    full_shapes,
    parse_dtype,
    updatable,
)
from sangam.sampling_params import RequestOutput, SamplingParams
from sangam.sched.front_core import FrontCore, FrontCounters, TransferRecord
from sangam.sched.messages import Order
from sangam.sched.placement import NeverFits, Placed, Placement
from sangam.sched.worker_core import IterationStats

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long for the pool, queue full...)."""


class ControlRefused(ValueError):
    """A weight update, cache flush or memory operation the workers refused (the model and
    the memory are as they were)."""


class QueueFull(RequestRejected):
    """Overload: more requests in flight than ``max_queue_len``; retry later."""


def check_queue(in_flight: int, max_queue_len: int, adding: int = 1) -> None:
    """Refuse ``adding`` more requests when, beside the ``in_flight`` ones, they would pass
    ``max_queue_len`` (the engine, ``AsyncEngine`` and the server all ask this)."""
    if in_flight + adding > max_queue_len:
        raise QueueFull(f"{in_flight} requests in flight (max_queue_len {max_queue_len})")


@dataclass
class EngineStats:
    iterations: deque[IterationStats] = field(default_factory=lambda: deque(maxlen=10_000))
    finished: deque = field(default_factory=lambda: deque(maxlen=10_000))  # RequestMetrics


def _memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    if tags is None:
        return MEMORY_TAGS
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad or not tags:
        raise ValueError(f"memory tags must be some of {MEMORY_TAGS}, got {list(tags)!r}")
    return tuple(dict.fromkeys(tags))


def tokens_per_forward(state: DecodeState) -> float:
    """Canvas tokens committed per forward spent: the parallelism diffusion decoding got."""
    return state.num_committed() / max(1, state.num_forwards)


class Front:
    """Invariants: FrontCore's; every request's record holds its decode state (``state``),
    whose cursor is the record's; an output is made only from the current attempt's
    reports."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_pages: list[int]):
        """``num_pages``: each worker's KV pool."""
        self.config = config
        self.loaded = loaded
        self.prefix_caching = prefix_caching(config, loaded)  # the workers cache prompt blocks
        self.core = FrontCore(config.deployment, num_pages, self._send)
        self.num_workers = len(num_pages)
        self.stats = EngineStats()
        self.clock: Callable[[], float] = time.monotonic
        self._outputs: list[RequestOutput] = []
        self._rng = random.Random(config.seed)
        # The weights' version: 0 as loaded, one more after each update; every output says
        # the version it was generated with (no update runs while a request is in flight).
        self.weights_version = 0
        self.released: set[str] = set()  # memory given back (release_memory_occupation)
        self._tickets = itertools.count(1)

    # The core's, by the names callers read.
    @property
    def requests(self) -> dict[str, Placed]:
        return self.core.requests

    @property
    def placement(self) -> Placement:
        return self.core.placement

    @property
    def counters(self) -> FrontCounters:
        return self.core.counters

    @property
    def transfers(self) -> deque[TransferRecord]:
        return self.core.transfers

    def _send(self, worker: int, order: Order) -> None:
        """Hand ``order`` to ``worker`` (the subclass's transport)."""
        raise NotImplementedError

    def _describe_workers(self) -> list[str]:
        raise NotImplementedError

    def describe(self) -> str:
        """One line on what serves: the model, its precision and device, the context, the
        workers, and the scheduling policy."""
        loaded, cfg = self.loaded, self.config
        budget = ("" if cfg.policy == "fastdllm"
                  else f", token budget {cfg.scheduler.budget}")
        return "; ".join([
            f"{loaded.config.architecture} from {loaded.path}",
            f"{str(loaded.dtype).removeprefix('torch.')} on {loaded.device}",
            f"context {loaded.context_length} tokens", *self._describe_workers(),
            f"policy {cfg.policy}{budget}"])

    # Requests in and out.
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    suffix_token_ids: list[int] = ()) -> None:
        """Validate and queue a request (with ``suffix_token_ids``: an infill between prompt
        and suffix); raises (RequestRejected, QueueFull, ValueError) and changes nothing if it
        cannot be served."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError(f"n={params.n}: a request is one sequence; submit n requests (as "
                             "LLM.generate and the server do)")
        check_queue(len(self.requests), self.config.max_queue_len)
        if "kv_cache" in self.released:
            raise RequestRejected("the KV cache is released (release_memory_occupation): "
                                  "resume_memory_occupation first")
        state = new_state(self.loaded, prompt_token_ids, params, self._rng, suffix_token_ids)
        now = self.clock() if arrival_time is None else arrival_time
        try:
            placed = self.core.add(request_id, now, state.cursor, priority=params.priority,
                                   state=state, prompt_ids=state.prompt_ids())
        except NeverFits as e:
            raise RequestRejected(str(e)) from None
        placed.text = IncrementalDetokenizer(params.skip_special_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        p = self.core.abort(request_id)
        return None if p is None else self._output(p, finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    def _place(self) -> None:
        self.core.place()

    # Weights, cache and memory (docs/design.md §3.1): every rank of every live worker, with
    # no request in flight (LLM is idle between generate calls; AsyncEngine waits).
    def update_weights_from_tensor(self, named_tensors: Mapping[str, torch.Tensor]
                                   | Sequence[tuple[str, torch.Tensor]]) -> int:
        """Copy full (unsharded) tensors, by checkpoint name, into the weights in place; the
        new weights version. Refused, changing nothing, when a name, shape, dtype or value
        does not fit."""
        named = list(named_tensors.items() if isinstance(named_tensors, Mapping)
                     else named_tensors)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2
                    and isinstance(item[1], torch.Tensor)):
                raise ValueError("named_tensors: (name, tensor) pairs or a {name: tensor} map")
        self._check_update([(n, tuple(t.shape), t.dtype) for n, t in named])
        # To worker processes, plain CPU tensors travel; in process the caller's are copied
        # from where they are (a colocated trainer's GPU tensors: no trip through the host).
        return self._update("update_tensors", [
            (n, t.detach().cpu().contiguous() if self.tensors_cross_processes else t.detach())
            for n, t in named])

    def update_weights_from_disk(self, model_path: str | os.PathLike) -> int:
        """Load the weights of the checkpoint at ``model_path`` (the same architecture, all
        of its tensors) in place; the new weights version."""
        specs = checkpoint_specs(model_path, self._full_shapes)
        check_same_model(self.loaded.config, model_path)
        self._check_update(specs)
        return self._update("update_disk", str(model_path), [n for n, _, _ in specs])

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str | None = None) -> None:
        """Join a trainer's weight-update group: the trainer is rank 0, this engine's ranks
        are ``rank_offset`` onwards (each worker's ranks in order). Blocks until every rank,
        the trainer's included, has joined."""
        backend = backend or ("nccl" if self.loaded.device.type == "cuda" else "gloo")
        check_group(master_address, master_port, 0, world_size, group_name, backend)
        ranks = self.num_engine_ranks
        if not isinstance(rank_offset, int) or not 1 <= rank_offset <= world_size - ranks:
            raise ValueError(f"rank_offset must leave room for this engine's {ranks} ranks in "
                             f"[1, world_size {world_size}), got {rank_offset!r}")
        self._control("join_group", master_address, master_port, rank_offset, world_size,
                      group_name, backend)

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]]) -> int:
        """Receive the tensors ``names`` (full shapes ``shapes``, ``dtypes`` by torch name)
        from the trainer's broadcasts, in that order, and copy them in place; the new weights
        version."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(names)}, "
                             f"{len(dtypes)}, {len(shapes)})")
        specs = [(n, tuple(int(x) for x in s), str(d).removeprefix("torch."))
                 for n, d, s in zip(names, dtypes, shapes)]
        self._check_update([(n, s, parse_dtype(d)) for n, s, d in specs])
        return self._update("update_distributed", specs)

    def flush_cache(self) -> None:
        """Empty every worker's prefix cache."""
        self._control("flush_cache")

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Give memory back (``tags``: "kv_cache", "weights"; default both) until
        ``resume_memory_occupation``: the KV pool's storage is freed (its contents and the
        prefix cache dropped; no request is accepted meanwhile), the weights' is freed after
        a copy to host memory."""
        tags = _memory_tags(tags)
        self._control("release", tags)
        self.released.update(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take back what ``release_memory_occupation`` gave (the weights as they were)."""
        tags = _memory_tags(tags)
        self._control("resume", tags)
        self.released.difference_update(tags)

    @property
    def num_engine_ranks(self) -> int:
        """The processes holding the model: each worker's tensor-parallel ranks."""
        return self.num_workers * self.config.tensor_parallel_size

    @functools.cached_property
    def _full_shapes(self) -> dict[str, tuple[int, ...]]:
        updatable(self.loaded.config)
        return full_shapes(self.loaded.config)

    def _check_update(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        if "weights" in self.released:
            raise ControlRefused("the weights are released (release_memory_occupation): "
                                 "resume_memory_occupation first")
        check_update(self._full_shapes, specs)

    def _update(self, op: str, *args: object) -> int:
        self._control(op, *args)
        self.weights_version += 1
        logger.info("weights updated (%s): version %d", op, self.weights_version)
        return self.weights_version

    def _control(self, op: str, *args: object) -> None:
        """Run ``op`` on every rank of every live worker; raises ``ControlRefused`` when they
        refused it."""
        if self.requests:
            raise RuntimeError(f"{op}: {len(self.requests)} requests are in flight; it runs "
                               "between requests (AsyncEngine and the server wait for them)")
        self._run_control(msg.Control(next(self._tickets), op, tuple(args)))

    tensors_cross_processes = False  # an update's tensors are pickled to worker processes

    def _run_control(self, m: msg.Control) -> None:
        raise NotImplementedError

    # Reports.
    def _on_report(self, w: int, events: list[msg.Event],
                   iterations: list[IterationStats]) -> None:
        self.stats.iterations.extend(iterations)
        now = self.clock()
        for ev in events:
            p = self.core.report(w, ev, now)
            if p is None:
                continue  # about work that was taken back, aborted or drained
            if isinstance(ev, msg.BlockDone):
                if ev.progress is not None:  # from another process: its copy of the block
                    msg.catch_up(p.state, ev.progress)
                if ev.finished:
                    self.stats.finished.append(p.metrics)
                self._outputs.append(self._output(p, ev.finished, p.state.finish_reason))
            elif isinstance(ev, msg.Draft):
                self._outputs.append(self._output(p, False, None, draft=ev.tokens))
            elif isinstance(ev, msg.RequestFailed):
                logger.error("request %s failed and was ended: %s", ev.request_id, ev.error)
                self._outputs.append(self._output(p, True, "error", ev.error))
            elif isinstance(ev, msg.KVSent) and not (ev.ok or ev.drain):
                logger.info("request %s restarts block %d: K/V transfer %d -> %d failed at the "
                            "sender", ev.request_id, p.cursor.block, w, ev.dest)
            elif isinstance(ev, msg.KVReceived) and not ev.ok:
                logger.info("request %s restarts block %d: K/V transfer %d -> %d failed",
                            ev.request_id, p.cursor.block, ev.src, w)

    def _take_back(self, w: int) -> None:
        """Worker ``w`` is gone: every request with anything on it restarts its block elsewhere
        (raises when no worker is left)."""
        for p, _ in self.core.worker_dead(w):
            logger.info("request %s restarts block %d: worker %d died", p.request_id,
                        p.cursor.block, w)

    # Outputs.
    def _output(self, p: Placed, finished: bool, reason: str | None,
                error: str | None = None, draft: list[int] | None = None) -> RequestOutput:
        return request_output(self.loaded.text, p.request_id, p.prompt_ids, p.state, finished,
                              reason, self._metrics(p), p.text, error,
                              p.cached_tokens if self.prefix_caching else None, draft,
                              self.weights_version)

    @staticmethod
    def _metrics(p: Placed) -> dict:
        """A request's latency breakdown (seconds), parallelism and K/V movement, as reported
        to users."""
        m = p.metrics
        return {
            "arrival_time": m.arrival_time,
            "finish_time": m.finish_time,
            "e2e_latency": m.e2e_latency,
            "time_to_first_block": m.time_to_first_block,
            "queueing_time": m.queueing_time,
            "decode_time": m.decode_time,
            "num_forwards": p.state.num_forwards,
            "num_blocks": len(m.block_finished),
            "num_refreshes": len(m.prefill_started),  # full, response-only and chunks, so far
            "tokens_per_forward": tokens_per_forward(p.state),
            "kv_bytes": p.kv_bytes,
            "kv_transfers": p.kv_transfers,
            "restarts": p.restarts,
        }
