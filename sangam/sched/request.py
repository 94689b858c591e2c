"""A request as the scheduler sees it: geometry, state machine, timing (DESIGN.md §4).

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

The refresh cadence (``refresh_interval``, ``prompt_refresh_interval``: SamplingParams') says
how each block starts: a full refresh (cost T), a response-only one (cost T - P), or none (the
request stays seated and its next cached step starts the block). Only a block that starts with
a full refresh can run anywhere; the others need the K/V the canvas holder kept. With
``force_refresh`` the current block starts with a full refresh whatever the cadence says: the
request's adaptive trigger fired (the driver says so in ``mark_step_done``), or its cached K/V
was lost (its worker died, a transfer failed).

A block-causal request (SDAR, ``block_causal``) lays its blocks on the grid from position 0, so
T is a multiple of B and block 0 starts at floor(P/B)·B. Only block 0 (or a block that lost its
K/V) starts with a "refresh": the forward over [0, e) that writes the prompt's K/V and takes the
block's first step. Every later block stays seated; its first step spans 2B (it writes the
finished block's final K/V) and the others B. That refresh is divisible at block boundaries:
with chunked prefill the scheduler may admit [prefilled, chunk_end) of the prompt's whole
blocks alone (a forward that only writes K/V), after which the request waits again, at the head
of the queue, for the rest.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from sangam.sampling_params import (
    CACHE_MODES,
    FULL_REFRESH,
    MAX_INT32,
    NO_REFRESH,
    block_refresh,
)

# Creation order, the tie-break after arrival time. next() on a count is atomic under the GIL.
_SEQ = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a refresh (its first block, or the next block's re-prefill)
    PREFILL = "prefill"  # admitted this iteration: its refresh is in the forward
    DECODE = "decode"  # seated: runs one cached step per iteration
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timestamps on the driver's clock (wall time in the engine, simulated in the simulator).

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
    """One generation request: prompt of ``prompt_len`` tokens, canvas of ``canvas_len`` masks,
    then (infilling) a suffix of ``suffix_len`` tokens.

    Invariants: ``canvas_len`` is a positive multiple of ``block_length``; ``0 <= block <
    num_blocks`` while not FINISHED; ``pages`` is empty until the first admission and then
    covers all ``total_len`` positions until the request finishes (the holder frees them).
    """

    def __init__(self, request_id: str, arrival_time: float, prompt_len: int, canvas_len: int,
                 block_length: int, cache: str = "dual", suffix_len: int = 0,
                 priority: int = 0, seq: int | None = None, refresh_interval: int = 1,
                 prompt_refresh_interval: int = 1, load_adaptive: bool = False,
                 block_causal: bool = False):
        if prompt_len < 1:
            raise ValueError(f"request {request_id!r}: prompt_len must be >= 1, got {prompt_len}")
        if block_causal and (block_length < 1 or canvas_len < 1 or suffix_len
                             or (prompt_len + canvas_len) % block_length):
            raise ValueError(
                f"request {request_id!r}: a block-causal canvas ({canvas_len}) must end the "
                f"prompt ({prompt_len}) on the grid of block_length ({block_length}), with no "
                "suffix")
        if not block_causal and (block_length < 1 or canvas_len < 1
                                 or canvas_len % block_length):
            raise ValueError(
                f"request {request_id!r}: canvas_len ({canvas_len}) must be a positive multiple "
                f"of block_length ({block_length})")
        if suffix_len < 0:
            raise ValueError(f"request {request_id!r}: suffix_len must be >= 0, got {suffix_len}")
        if cache not in CACHE_MODES:
            raise ValueError(f"request {request_id!r}: cache must be one of {CACHE_MODES}, "
                             f"got {cache!r}")
        if not (1 <= refresh_interval <= MAX_INT32 and 1 <= prompt_refresh_interval <= MAX_INT32):
            raise ValueError(f"request {request_id!r}: refresh intervals must be in "
                             f"[1, {MAX_INT32}], got {refresh_interval}, "
                             f"{prompt_refresh_interval}")
        self.request_id = request_id
        self.arrival_time = arrival_time
        self.prompt_len = prompt_len
        self.canvas_len = canvas_len
        self.block_length = block_length
        self.cache = cache
        self.refresh_interval = refresh_interval
        self.prompt_refresh_interval = prompt_refresh_interval
        self.load_adaptive = load_adaptive  # its blocks' thresholds follow the worker's load
        self.priority = priority  # vLLM's: lower is served first; ties by arrival
        # Its place among equal arrivals: kept by the copies a worker schedules (``seq``).
        self.seq = next(_SEQ) if seq is None else seq
        self.block_causal = block_causal
        self.total_len = prompt_len + canvas_len + suffix_len
        # Where block 0 starts: after the prompt, or on the grid below its end (block-causal).
        self.block_origin = prompt_len // block_length * block_length if block_causal \
            else prompt_len
        self.num_blocks = (prompt_len + canvas_len - self.block_origin) // block_length
        self.block_first_step = False  # seated at a block that starts without a refresh
        self.prefilled = 0  # block-causal: prompt positions whose K/V is stored (whole blocks)
        self.chunk_end: int | None = None  # admitted as a prefill chunk [prefilled, chunk_end)
        self.block = 0
        self.status = RequestStatus.WAITING
        self.pages: list[int] = []
        self.force_refresh = False  # the current block starts with a full refresh regardless
        self.finish_reason: str | None = None
        self.worker: int | None = None
        self.metrics = RequestMetrics(arrival_time, prefill_queued=[arrival_time])

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"block={self.block}/{self.num_blocks}, T={self.total_len}, cache={self.cache})")

    def block_refresh(self, block: int) -> str:
        """How ``block`` starts by the cadence: FULL_REFRESH, RESPONSE_REFRESH or NO_REFRESH."""
        return block_refresh(block, self.refresh_interval, self.prompt_refresh_interval)

    @property
    def block_start(self) -> str:
        """How the current block starts: as the cadence says, or fully if the cache was lost."""
        return FULL_REFRESH if self.force_refresh else self.block_refresh(self.block)

    # Costs, in tokens of forward span.
    @property
    def prefill_cost(self) -> int:
        """The current block's refresh: a full one spans all T positions (bidirectional
        attention: it cannot be chunked), a response-only one [P, T); block-causal, [0, e)."""
        if self.block_causal:
            return self.block_origin + (self.block + 1) * self.block_length - self.prefilled
        if self.block_start == FULL_REFRESH:
            return self.total_len
        return self.total_len - self.prompt_len

    @property
    def decode_span(self) -> int:
        """Span of one cached step in the current block (DESIGN.md §2)."""
        if self.block_causal:  # a seated block's first step also stores the finished one
            return self.block_length * (2 if self.block_first_step else 1)
        if self.cache == "dual":
            return self.block_length
        if self.cache == "prefix":
            return self.total_len - (self.prompt_len + self.block * self.block_length)
        return self.total_len  # "none": every step is a refresh

    def chunk_room(self, budget: int | float) -> int:
        """The longest prefill chunk of this request within ``budget`` tokens: whole blocks of
        its prompt not yet stored (the block with the first masks is never split off); 0 if
        none fits."""
        if not self.block_causal or self.block_start != FULL_REFRESH:
            return 0
        room = self.block_origin - self.prefilled
        if budget < room:
            room = int(budget) // self.block_length * self.block_length
        return max(0, room)

    @property
    def queue_key(self) -> tuple[int, float, int]:
        """Queue order, smaller first: priority, then original arrival, then creation order.
        Never changes."""
        return (self.priority, self.arrival_time, self.seq)

    def pages_needed(self, page_size: int) -> int:
        """Pages that hold the whole canvas: ceil(T / page_size)."""
        return -(-self.total_len // page_size)

    # Transitions.
    def mark_admitted(self, now: float) -> None:
        self._expect("mark_admitted", RequestStatus.WAITING)
        self.status = RequestStatus.PREFILL
        self.metrics.prefill_started.append(now)

    def mark_step_done(self, now: float, block_done: bool, finished: bool,
                       finish_reason: str | None = None, force_refresh: bool = False) -> None:
        """Record one forward. ``finished`` wins over ``block_done`` (a request finishes when a
        block completes); ``finish_reason`` defaults to "length" on the last block, else "stop".
        ``force_refresh``: the next block starts with a full refresh (the adaptive trigger).
        """
        self._expect("mark_step_done", RequestStatus.PREFILL, RequestStatus.DECODE)
        if block_done and not finished and self.block + 1 == self.num_blocks:
            raise ValueError(f"{self!r}: the last block is done, so the request must finish")
        m = self.metrics
        m.num_steps += 1
        self.block_first_step = False
        if self.status is RequestStatus.PREFILL and self.chunk_end is not None:
            # A prefill chunk: its K/V is stored; the rest of the prefill waits again.
            m.prefill_finished.append(now)
            m.prefill_queued.append(now)
            self.prefilled, self.chunk_end = self.chunk_end, None
            self.status = RequestStatus.WAITING
            return
        if self.status is RequestStatus.PREFILL:
            m.prefill_finished.append(now)
            m.decode_started.append(now)
            self.force_refresh = False
            self.prefilled = 0
        if finished:
            m.block_finished.append(now)
            self._finish(now, finish_reason or (
                "length" if self.block + 1 == self.num_blocks else "stop"))
        elif block_done:
            m.block_finished.append(now)
            self.block += 1
            self.force_refresh = force_refresh
            if self.block_start == NO_REFRESH:  # stays seated
                m.decode_started.append(now)
                self.status = RequestStatus.DECODE
                self.block_first_step = True
            else:
                m.prefill_queued.append(now)
                self.status = RequestStatus.WAITING
        else:
            self.status = RequestStatus.DECODE

    def mark_aborted(self, now: float) -> None:
        self._expect("mark_aborted", RequestStatus.WAITING, RequestStatus.PREFILL,
                     RequestStatus.DECODE)
        self._finish(now, "abort")

    def _finish(self, now: float, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = now

    def _expect(self, what: str, *allowed: RequestStatus) -> None:
        if self.status not in allowed:
            raise ValueError(f"{what} on {self!r}: needs status "
                             f"{' or '.join(s.name for s in allowed)}")
