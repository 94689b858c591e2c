"""A request as a worker runs it: its state machine, its place in the scheduler and its timeline
(docs/design.md §4), around its ``BlockCursor`` (the block geometry and position, which the
decoder of the same request shares), with what the front asked of this block (its attempt, where
its K/V goes, whether the worker keeps the canvas) and what the driver runs it with.

Pure Python, no tensors: the engine and the simulator drive the same objects.

Life of a request (B = block length, one refresh then cached steps per block)::

    WAITING --mark_admitted--> PREFILL --mark_step_done--> DECODE --mark_step_done--> ...
       ^                          |                          |  ^
       +-------- block done ------+--------------------------+  |  (re-prefill of the next
                                  |                          |  |   block, same priority)
                                  |                          +--+  block done, the next one
                                  |                          |     starts without a refresh
                                  +------ finished ----------+--> FINISHED
    any state but FINISHED --mark_aborted--> FINISHED (finish_reason "abort")

The cursor says how each block starts (``block_start``): a full refresh, a response-only one, or
none (the request stays seated and its next cached step starts the block); every cost is the
span of the next forward (``BlockCursor.span``). Only a block that starts with a full refresh can
run anywhere; the others need the K/V the canvas holder kept. A block-causal request (SDAR)
refreshes its block 0 only, and with chunked prefill the scheduler may admit part of that
refresh (``admit_chunk``): a forward that only stores K/V, after which the request waits again,
at the head of the queue, for the rest.

The driver moves the cursor when a step commits (the decoder's commit; the simulator's step
model), then reports the step's ``StepOutcome`` here: the transitions only record.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from sangam.sched.block_cursor import NO_REFRESH, BlockCursor

# Creation order, the tie-break after arrival time. next() on a count is atomic under the GIL.
_SEQ = itertools.count()


def creation_order() -> int:
    """The next request's place among equal arrivals (``Request.seq``, ``Placed.seq``)."""
    return next(_SEQ)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a refresh (its first block, or the next block's re-prefill)
    PREFILL = "prefill"  # admitted this iteration: its refresh is in the forward
    DECODE = "decode"  # seated: runs one cached step per iteration
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one forward did to one request: its block ended (``block_done``), the request
    ended (``finished``, with ``finish_reason``; a request finishes when a block completes), or
    it failed (``error``: it ends with that error, alone)."""

    block_done: bool = False
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


CONTINUES = StepOutcome()  # the most common outcome: the block goes on
BLOCK_DONE = StepOutcome(block_done=True)


@dataclass
class RequestMetrics:
    """Timestamps on the driver's clock (wall time in the engine, simulated in the simulator),
    written only by transitions: a worker's ``Request`` records its own steps; the front's
    ``Placed`` (``placement.py``) records what the workers report, which is what users see.

    Per-block lists are indexed by block; an entry is appended when the event happens, so an
    aborted request may have a queued time without a start.
    """

    arrival_time: float
    prefill_queued: list[float] = field(default_factory=list)  # entered the queue for block b
    prefill_started: list[float] = field(default_factory=list)  # admitted (refresh scheduled)
    prefill_finished: list[float] = field(default_factory=list)  # refresh forward done
    # Cached steps began: a refresh ended, or a block that starts without one began.
    decode_started: list[float] = field(default_factory=list)
    block_finished: list[float] = field(default_factory=list)  # last mask of block b committed
    finish_time: float | None = None
    num_steps: int = 0  # forwards spent: refreshes + cached steps

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish; None while the request runs."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queueing_time(self) -> float:
        """Total time spent waiting for admission, over every prefill that started."""
        return sum(s - q for q, s in zip(self.prefill_queued, self.prefill_started))

    @property
    def decode_time(self) -> float:
        """Total time of cached steps: from each block's refresh end (or, without a refresh,
        its start) to the block's end."""
        return sum(b - d for d, b in zip(self.decode_started, self.block_finished))

    @property
    def time_to_first_block(self) -> float | None:
        """The streaming analogue of time-to-first-token."""
        return self.block_finished[0] - self.arrival_time if self.block_finished else None


class Request:
    """One generation request on a worker: its cursor (``cursor``: geometry and position), its
    place in the scheduler (``status``, ``pages``), its timeline here (``metrics``), what the
    front asked of its current block (``attempt``, ``kv_dest``, ``keep_pages``, ``stays``,
    ``starts_block``) and what the driver runs it with (``state``: a ``DecodeState`` on a real
    worker, the simulator's draws in the simulator).

    Invariants: ``pages`` is empty until the first admission and then covers all ``total_len``
    positions until the request finishes (the holder frees them), and so does
    ``window_pages`` under a hybrid pool; the status moves only through
    the transitions below.
    """

    def __init__(self, request_id: str, arrival_time: float, cursor: BlockCursor, *,
                 priority: int = 0, seq: int | None = None, load_adaptive: bool = False,
                 state: Any = None, attempt: int = 0, kv_dest: int | None = None,
                 keep_pages: bool = False, stays: bool = False, starts_block: bool = False):
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.cursor = cursor
        self.priority = priority  # vLLM's: lower is served first; ties by arrival
        # Its place among equal arrivals: kept by the copies a worker schedules (``seq``).
        self.seq = creation_order() if seq is None else seq
        self.load_adaptive = load_adaptive  # its blocks' thresholds follow the worker's load
        self.state = state
        self.attempt = attempt
        self.kv_dest = kv_dest  # a refresh for another worker: its K/V goes there
        self.keep_pages = keep_pages  # this worker holds the canvas after the block
        self.stays = stays  # every next block runs here too (colocated): it never leaves
        # Received K/V of a refresh that ended its block: the request starts its next block here.
        self.starts_block = starts_block
        self.streamed = False  # its K/V goes out layer by layer during this forward
        self.status = RequestStatus.WAITING
        self.pages: list[int] = []
        self.window_pages: list[int] = []  # its ring under a hybrid pool (window_rings.py)
        self.finish_reason: str | None = None
        self.chunk_admitted = False  # its prefill in flight is a chunk (the rest waits)
        self.metrics = RequestMetrics(arrival_time, prefill_queued=[arrival_time])
        # Prefix caching (block-causal models): the keys of its pages whose K/V is or will be
        # final (``prefix_page_keys``: the prompt's whole blocks, then its finished blocks';
        # None: not cached), how many of its first pages are cached or published, the pages
        # its forward in flight makes final, and the prompt tokens found cached.
        self.page_keys: list[bytes] | None = None
        self.published = 0
        self.pending_pages: list[int] = []
        self.cached_tokens = 0

    def __repr__(self) -> str:
        c = self.cursor
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"block={c.block}/{c.num_blocks}, T={c.total_len}, cache={c.cache})")

    @property
    def queue_key(self) -> tuple[int, float, int]:
        """Queue order, smaller first: priority, then original arrival, then creation order.
        Never changes."""
        return (self.priority, self.arrival_time, self.seq)

    # Transitions on a worker.
    def mark_admitted(self, now: float, chunk: int = 0) -> None:
        """Admitted for its refresh, or (``chunk`` > 0 tokens) for a chunk of it."""
        self._expect("mark_admitted", RequestStatus.WAITING)
        self.status = RequestStatus.PREFILL
        self.metrics.prefill_started.append(now)
        if chunk:
            self.cursor.admit_chunk(chunk)
            self.chunk_admitted = True

    def mark_step_done(self, now: float, outcome: StepOutcome) -> None:
        """Record one forward, the cursor already moved by it: a chunk waits again for the
        rest; a block's end leaves the request seated (its next block starts from cached K/V)
        or waiting for the next refresh; ``finish_reason`` defaults to "length" on the last
        block, else "stop"."""
        m = self.metrics
        if self.status is RequestStatus.DECODE and not outcome.block_done:  # the common case
            m.num_steps += 1
            return
        self._expect("mark_step_done", RequestStatus.PREFILL, RequestStatus.DECODE)
        m.num_steps += 1
        if self.status is RequestStatus.PREFILL:
            m.prefill_finished.append(now)
            if self.chunk_admitted:  # its K/V is stored; the rest of the prefill waits again
                self.chunk_admitted = False
                m.prefill_queued.append(now)
                self.status = RequestStatus.WAITING
                return
            m.decode_started.append(now)
        if outcome.finished:
            m.block_finished.append(now)
            c = self.cursor
            self._finish(now, outcome.finish_reason or (
                "length" if c.block + 1 == c.num_blocks else "stop"))
        elif outcome.block_done:
            self._block_ended(now)
        else:
            self.status = RequestStatus.DECODE

    def mark_seated(self, now: float) -> None:
        """Its refresh ran on another worker (or none was due): seated for cached steps."""
        self._expect("mark_seated", RequestStatus.WAITING)
        self.status = RequestStatus.DECODE

    def mark_aborted(self, now: float) -> None:
        self._expect("mark_aborted", RequestStatus.WAITING, RequestStatus.PREFILL,
                     RequestStatus.DECODE)
        self._finish(now, "abort")

    def _block_ended(self, now: float) -> None:
        self.metrics.block_finished.append(now)
        if self.cursor.block_start == NO_REFRESH:  # stays seated
            self.metrics.decode_started.append(now)
            self.status = RequestStatus.DECODE
        else:  # the next block's refresh, same priority
            self.metrics.prefill_queued.append(now)
            self.status = RequestStatus.WAITING

    def _finish(self, now: float, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = now

    def _expect(self, what: str, *allowed: RequestStatus) -> None:
        if self.status not in allowed:
            raise ValueError(f"{what} on {self!r}: needs status "
                             f"{' or '.join(s.name for s in allowed)}")
