"""The front of an engine (docs/design.md §1, §4): the request table, ``Placement`` (where each
block runs, when K/V moves, what a failure takes back) and the outputs made from what the
workers report.

It never touches the model. Per request it keeps a ``DecodeState``: in process the very state
its worker runs, across processes a copy kept at the start of the request's next block (a
token array: all that recovery needs, because a block's refresh recomputes every layer's K/V
from the tokens alone), caught up from the block reports. ``Engine`` (engine.py) is a front over
one in-process worker; ``MultiWorkerEngine`` (multi/front.py) a front over worker processes.
Both speak to their workers in the same messages (``messages.py``) and hear the same reports.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine import messages as msg
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.outputs import request_output
from sangam.engine.validation import new_state
from sangam.engine.worker import prefix_caching, scheduling_request
from sangam.sampling_params import RequestOutput, SamplingParams
from sangam.sched.placement import NeverFits, Placed, Placement
from sangam.sched.worker_core import IterationStats

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never be served as asked (too long for the pool, queue full...)."""


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


@dataclass
class Counters:
    kv_transfers: int = 0
    kv_bytes: int = 0
    kv_budget_waits: int = 0  # receives that waited for transfer buffer budget
    blocks: int = 0  # blocks completed
    # The control plane to worker processes, both ways (heartbeats aside): what moving
    # requests between workers costs beyond their K/V.
    control_messages: int = 0
    control_bytes: int = 0

    def count(self, data: bytes) -> None:
        self.control_messages += 1
        self.control_bytes += len(data)


@dataclass
class TransferRecord:
    request_id: str
    src: int
    dst: int
    num_pages: int
    bytes_sent: int
    streamed_layers: int
    drained: bool  # the receiver was told to discard it
    bytes_received: int | None = None  # None until the receiver reports; then == bytes_sent
    ok: bool | None = None


@dataclass
class _Entry:
    placed: Placed  # where it is (Placement's); its request shares the state's cursor
    state: DecodeState  # at the start of the next block to run (or finished)
    prompt_ids: list[int]
    kv_bytes: int = 0
    kv_transfers: int = 0
    cached_tokens: int = 0  # prompt tokens its current attempt found in the prefix cache
    # The worker that parked the canvas with a copy of ``state`` (it ended the last block
    # there and has not been sent the request since): it is sent no state, only progress.
    parked_on: int | None = None
    text: IncrementalDetokenizer = field(init=False)  # the outputs' text

    def __post_init__(self) -> None:
        self.text = IncrementalDetokenizer(self.state.params.skip_special_tokens)


def tokens_per_forward(state: DecodeState) -> float:
    """Canvas tokens committed per forward spent: the parallelism diffusion decoding got."""
    committed = int((state.tokens[state.prompt_len:state.canvas_end] != state.mask_token_id).sum())
    return committed / max(1, state.num_forwards)


class Front:
    """Invariants: every request in ``requests`` is in ``placement`` (same id, and its
    request's cursor is its state's); an output is made only from the current attempt's
    reports."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, num_pages: list[int]):
        """``num_pages``: each worker's KV pool."""
        self.config = config
        self.loaded = loaded
        self.prefix_caching = prefix_caching(config, loaded)  # the workers cache prompt blocks
        self.placement = Placement(config.deployment, num_pages)
        self.requests: dict[str, _Entry] = {}
        self.stats = EngineStats()
        self.counters = Counters()
        self.transfers: deque[TransferRecord] = deque(maxlen=100_000)
        self._open_transfers: dict[tuple[int, int], TransferRecord] = {}
        self._outputs: list[RequestOutput] = []
        self._rng = random.Random(config.seed)

    def _send(self, worker: int, message: object) -> None:
        """Hand ``message`` to ``worker`` (the subclass's transport)."""
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
        state = new_state(self.loaded, prompt_token_ids, params, self._rng, suffix_token_ids)
        now = time.monotonic() if arrival_time is None else arrival_time
        try:
            placed = self.placement.add(scheduling_request(request_id, now, state))
        except NeverFits as e:
            raise RequestRejected(str(e)) from None
        self.requests[request_id] = _Entry(placed, state, state.prompt_ids())

    def abort_request(self, request_id: str) -> RequestOutput | None:
        e = self.requests.pop(request_id, None)
        if e is None:
            return None
        self._drop(request_id, self.placement.remove(request_id))
        return self._output(e, finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # Placement's decisions, as messages.
    def _place(self) -> None:
        for d in self.placement.place():
            e = self.requests[d.request_id]
            r = e.placed.request
            self._send(d.worker, msg.Prefill(d.request_id, d.attempt, self._state_for(e, d.worker),
                                             r.arrival_time, r.seq, d.kv_dest, d.keep_pages,
                                             d.stays))

    @staticmethod
    def _state_for(e: _Entry, w: int) -> DecodeState | None:
        """What ``w`` is sent of the request's state: none if it parked a copy (which the
        message then takes out of parking), else the snapshot."""
        if e.parked_on == w:
            e.parked_on = None
            return None
        return e.state

    def _drop(self, request_id: str, workers: set[int]) -> None:
        e = self.requests.get(request_id)
        if e is not None and e.parked_on in workers:
            e.parked_on = None
        for w in workers:
            self._send(w, msg.Drop(request_id))

    # Reports.
    def _on_report(self, w: int, events: list[msg.Event],
                   iterations: list[IterationStats]) -> None:
        self.stats.iterations.extend(iterations)
        for ev in events:
            e = self.requests.get(ev.request_id)
            current = e is not None and ev.attempt == e.placed.attempt
            if isinstance(ev, msg.KVReceived):
                self.counters.kv_budget_waits += ev.budget_wait
                record = self._open_transfers.pop((ev.src, ev.transfer_id), None)
                if record is not None:
                    record.bytes_received, record.ok = ev.nbytes, ev.ok
                    current = current and not record.drained
            if isinstance(ev, msg.KVSent):
                self._on_kv_sent(w, ev, e if current else None)
            elif not current:
                continue  # about work that was taken back or aborted
            elif isinstance(ev, msg.RefreshRan):
                now = time.monotonic()
                self.placement.refreshed(e.placed, w, now - ev.seconds, now, ev.chunk)
                e.cached_tokens = ev.cached_tokens
            elif isinstance(ev, msg.KVReceived):
                self._on_kv_received(w, ev, e)
            elif isinstance(ev, msg.BlockDone):
                self._on_block_done(w, ev, e)
            elif isinstance(ev, msg.RequestFailed):
                self._on_request_failed(ev, e)

    def _on_kv_sent(self, w: int, ev: msg.KVSent, e: _Entry | None) -> None:
        drain = self.placement.kv_sent(None if e is None else e.placed, w, ev.dest, ev.drain)
        failed = not ev.ok and not drain  # filler went out: the receiver discards it
        record = TransferRecord(ev.request_id, w, ev.dest, ev.num_pages, ev.nbytes,
                                ev.streamed_layers, drain or failed)
        self.transfers.append(record)
        if ev.dest in self.placement.dead:
            return  # the sender abandons it (PeerDead); the request was taken back
        self._open_transfers[(w, ev.transfer_id)] = record
        arrival, seq = ((e.placed.request.arrival_time, e.placed.request.seq) if e is not None
                        else (0.0, 0))
        state, progress = ((None, None) if record.drained
                           else (self._state_for(e, ev.dest), ev.progress))
        self._send(ev.dest, msg.ReceiveKV(ev.request_id, ev.attempt, w, ev.transfer_id,
                                          ev.num_pages, state, progress, arrival, seq,
                                          record.drained))
        if failed:
            logger.info("request %s restarts block %d: K/V transfer %d -> %d failed at the "
                        "sender", ev.request_id, e.state.block, w, ev.dest)
            self._drop(ev.request_id, self.placement.kv_received(e.placed, ev.dest, False, []))
        if record.drained:
            return
        e.kv_bytes += ev.nbytes
        e.kv_transfers += 1
        self.counters.kv_transfers += 1
        self.counters.kv_bytes += ev.nbytes

    def _on_kv_received(self, w: int, ev: msg.KVReceived, e: _Entry) -> None:
        if not ev.ok:
            logger.info("request %s restarts block %d: K/V transfer %d -> %d failed",
                        ev.request_id, e.state.block, ev.src, w)
        self._drop(ev.request_id, self.placement.kv_received(e.placed, w, ev.ok, ev.pages))

    def _on_block_done(self, w: int, ev: msg.BlockDone, e: _Entry) -> None:
        if ev.progress is not None:  # from another process: its copy of the block
            msg.catch_up(e.state, ev.progress)
        st = e.state
        rid = ev.request_id
        if ev.continues:  # the next block runs on without being placed
            self.placement.block_continued(e.placed, st.num_forwards, time.monotonic())
        else:
            e.parked_on = w if ev.pages else None
            self._drop(rid, self.placement.block_done(e.placed, w, st.finished, st.num_forwards,
                                                      list(ev.pages), time.monotonic()))
        self.counters.blocks += 1
        if st.finished:
            del self.requests[rid]
            self.stats.finished.append(e.placed.request.metrics)
        self._outputs.append(self._output(e, st.finished, st.finish_reason))

    def _on_request_failed(self, ev: msg.RequestFailed, e: _Entry) -> None:
        rid = ev.request_id
        logger.error("request %s failed and was ended: %s", rid, ev.error)
        del self.requests[rid]
        self._drop(rid, self.placement.remove(rid))
        self._outputs.append(self._output(e, True, "error", ev.error))

    def _take_back(self, w: int) -> None:
        """Worker ``w`` is gone: every request with anything on it restarts its block elsewhere
        (raises when no worker is left)."""
        for key, record in list(self._open_transfers.items()):
            if record.dst == w:  # its report will never come
                record.ok = False
                del self._open_transfers[key]
        for e in self.requests.values():
            if e.parked_on == w:
                e.parked_on = None
        taken = self.placement.worker_dead(w)
        for other in range(len(self.placement.roles)):
            if other not in self.placement.dead:
                self._send(other, msg.PeerDead(w))
        for placed, drops in taken:
            logger.info("request %s restarts block %d: worker %d died", placed.request_id,
                        placed.request.block, w)
            self._drop(placed.request_id, drops)

    # Outputs.
    def _output(self, e: _Entry, finished: bool, reason: str | None,
                error: str | None = None) -> RequestOutput:
        return request_output(self.loaded.text, e.placed.request_id, e.prompt_ids, e.state,
                              finished, reason, self._metrics(e), e.text, error,
                              e.cached_tokens if self.prefix_caching else None)

    @staticmethod
    def _metrics(e: _Entry) -> dict:
        """A request's latency breakdown (seconds), parallelism and K/V movement, as reported
        to users."""
        m = e.placed.request.metrics
        return {
            "arrival_time": m.arrival_time,
            "finish_time": m.finish_time,
            "e2e_latency": m.e2e_latency,
            "time_to_first_block": m.time_to_first_block,
            "queueing_time": m.queueing_time,
            "decode_time": m.decode_time,
            "num_forwards": e.state.num_forwards,
            "num_blocks": len(m.block_finished),
            "num_refreshes": len(m.prefill_started),  # full, response-only and chunks, so far
            "tokens_per_forward": tokens_per_forward(e.state),
            "kv_bytes": e.kv_bytes,
            "kv_transfers": e.kv_transfers,
            "restarts": e.placed.restarts,
        }
