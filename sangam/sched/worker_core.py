"""One worker's requests and its iteration (docs/design.md §1, §4): the engine core that the
in-process engine, the worker process and the simulator's workers all run::

    batch = core.schedule(now)                         # None: nothing to run now
    outcomes = <the runner: one forward over batch.requests, moving their cursors>
    events = core.complete(batch, outcomes, start, end)

The runner is the model (``engine/model_runner.py``, through the worker) or the simulator's
cost and step models; ``complete`` applies the outcomes in one place and says what the driver
must do or report (``IterationEvents``).

A worker keeps one ``Request`` per request it runs: the scheduler's record, with what the front
asked of its block and the driver's ``state``. Its work on a worker is one of:
- a whole block (``take_block`` without ``kv_dest``): refresh then cached steps. At the block's
  end the request stays (``stays``: its next block runs here anyway, colocated), or leaves the
  builder with its canvas pages and state kept (``keep_pages``: *parked* until its next block
  or K/V arrives) or freed;
- a refresh for another worker (``kv_dest`` set): temporary pages for the whole canvas, one
  forward, the K/V shipped to ``kv_dest``, pages freed;
- cached steps after a received refresh (``expect_kv``, then ``kv_arrived``): the K/V lands in
  the canvas pages and the request is seated with the state the sender shipped.

A block that starts from cached K/V (its cadence gives it a response-only refresh or none) is
never placed again: it *continues* where the canvas is (the request stays in the builder); a
refresh for another worker that ended its block ships its K/V anyway, and the receiver starts
the next block there (``Request.starts_block``).

With layer-wise K/V streaming, a forward's first refresh for each receiver sends its layers
while the forward runs (``Request.streamed``, chosen by ``schedule``); such a send is under way
even when the refresh turns out to need no K/V (it ended its block and the next is placed
again), so it still ships, for the receiver to drain. A refresh that was not streamed and needs
no K/V ships nothing.

Pure Python: ``Request.state`` is whatever the driver runs a request with (a DecodeState on a
real worker, the simulator's draws in the simulator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.block_cursor import FULL_REFRESH, NO_REFRESH
from sangam.sched.messages import BlockDone, RefreshRan, RequestFailed
from sangam.sched.request import CONTINUES, Request, RequestStatus, StepOutcome


@dataclass
class Receiving:
    """K/V on its way here; ``pages`` None: drained (no room, dropped meanwhile, or asked)."""

    request_id: str
    attempt: int
    request: Request | None  # what is seated when it lands (None: a drain asked for)
    pages: list[int] | None


@dataclass
class IterationStats:
    prefill_tokens: int
    decode_tokens: int
    deficit: int
    batch_size: int
    num_prefills: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Ship:
    """Send ``request``'s refresh K/V (in ``pages``) to its ``kv_dest``; ``drain``: the refresh
    failed or ended its block and the next one is placed again, so the receiver discards it
    (only a streamed send, already under way, ships drained). The pages are free in the
    allocator once ``complete`` returns: the driver ships before it schedules again."""

    request: Request
    block: int  # the block whose refresh ran
    pages: list[int]
    drain: bool
    streamed: bool = False  # its send began during the forward (layer-wise streaming)


@dataclass(frozen=True, slots=True)
class BlockEnded:
    """``request``'s block ``block`` ended here (it ``finished`` there, or not). ``kept``: the
    canvas pages this worker parked with its state (empty: none kept); None: the next block
    continues without being placed (here, or on the receiver of this refresh's K/V)."""

    request: Request
    block: int
    finished: bool
    kept: list[int] | None


@dataclass(frozen=True, slots=True)
class Failed:
    """``request``'s step failed: everything it held here is freed; it ends with ``error``."""

    request: Request
    error: str


class IterationEvents(NamedTuple):
    """What an iteration leaves the driver to report or do, in this order."""

    # Their refresh forward ran (or, with True, a chunk of it: the rest waits).
    refreshed: list[tuple[Request, bool]]
    ships: list[Ship]
    ended: list[BlockEnded | Failed]  # in batch order
    stats: IterationStats

    # The front's reports of them (sched/messages.py), as every driver sends them: the
    # refreshes' first, then (after the driver's ``KVSent`` of each ship) the blocks' ends.
    def refresh_reports(self, seconds: float) -> list[RefreshRan]:
        """The refreshes that ran in this iteration's forward of ``seconds``."""
        return [RefreshRan(r.request_id, r.attempt, seconds, chunk, r.cached_tokens)
                for r, chunk in self.refreshed]

    def end_reports(self, progress: Callable[[Request, int], Any] | None = None
                    ) -> list[BlockDone | RequestFailed]:
        """The blocks that ended (each request's cursor and ``state.num_forwards`` as they are
        now; ``progress(request, block)``: what the block changed, for a front in another
        process) and the requests that failed."""
        out: list[BlockDone | RequestFailed] = []
        for ev in self.ended:
            r = ev.request
            if isinstance(ev, BlockEnded):
                c = r.cursor
                out.append(BlockDone(
                    r.request_id, r.attempt, c.block, c.step, c.force_refresh,
                    r.state.num_forwards, ev.finished, list(ev.kept or ()),
                    continues=ev.kept is None,
                    progress=None if progress is None else progress(r, ev.block)))
            else:
                out.append(RequestFailed(r.request_id, r.attempt, ev.error))
        return out


DECODE = RequestStatus.DECODE


class WorkerCore:
    """Invariants: a request is in at most one of ``tasks`` (in the builder), ``ready`` (K/V
    landed, waiting for a seat) and ``parked`` (canvas kept between blocks); every page it
    holds here is in exactly one of them, or in a receive."""

    def __init__(self, builder: BatchBuilder, streaming: bool = False):
        """``streaming``: refreshes for other workers send their K/V layer by layer during the
        forward (``--layerwise-kv-streaming``)."""
        self.builder = builder
        self.allocator = builder.allocator
        self.streaming = streaming
        self.tasks: dict[str, Request] = {}
        self.ready: dict[str, Request] = {}
        self.parked: dict[str, tuple[list[int], Any]] = {}  # canvas pages, state
        self.receiving: dict[object, Receiving] = {}

    @property
    def busy(self) -> bool:
        return bool(self.tasks or self.ready or self.receiving)

    # Work in.
    def take_block(self, req: Request) -> None:
        """Queue a block's refresh (its canvas, if parked here, refreshes in place)."""
        rid = req.request_id
        if rid in self.tasks or rid in self.ready:
            raise RuntimeError(f"{rid!r} is already running here")
        req.pages = self.parked.pop(rid, ([], None))[0]
        self.builder.add(req)
        self.tasks[rid] = req

    def expect_kv(self, key: object, request_id: str, attempt: int, req: Request | None,
                  num_pages: int) -> None:
        """A refresh's K/V is coming (transfer ``key``), to be seated as ``req``: into the
        parked canvas, or fresh pages if there is room; otherwise (or with no ``req``: a drain
        asked for) it is received and discarded."""
        pages = None
        if req is not None:
            pages = self.parked.pop(request_id, (None,))[0]
            if pages is None and self.allocator.can_allocate(num_pages):
                pages = self.allocator.allocate(num_pages)
        self.receiving[key] = Receiving(request_id, attempt, req, pages)

    def kv_arrived(self, key: object, ok: bool, now: float) -> tuple[Receiving, bool]:
        """Transfer ``key`` ended (``ok``: its data arrived). Returns it, and whether it was
        seated (else its pages are freed)."""
        r = self.receiving.pop(key)
        if ok and r.pages is not None:
            req = r.request
            req.pages = r.pages
            if req.starts_block and req.cursor.block_start != NO_REFRESH:
                self.builder.add(req)  # its response-only refresh runs here
                self.tasks[r.request_id] = req
                return r, True
            req.mark_seated(now)  # the refresh ran on the sender (or: none is due)
            self.ready[r.request_id] = req
            return r, True
        if r.pages is not None:
            self.allocator.free(r.pages)
        return r, False

    def drop(self, request_id: str) -> None:
        """Forget a request and free whatever it holds here; a receive in progress drains."""
        req = self.ready.pop(request_id, None)
        if req is not None:
            self.allocator.free(req.pages)
        if self.tasks.pop(request_id, None) is not None:
            self.builder.abort(request_id)  # frees its pages
        pages = self.parked.pop(request_id, ([], None))[0]
        if pages:
            self.allocator.free(pages)
        for r in self.receiving.values():
            if r.request_id == request_id and r.pages is not None:
                self.allocator.free(r.pages)
                r.pages = None

    def parked_state(self, request_id: str) -> Any:
        """What a parked request was last run with (its next block starts from it)."""
        if request_id not in self.parked:
            raise RuntimeError(f"{request_id!r} is not parked here")
        return self.parked[request_id][1]

    # The iteration.
    def schedule(self, now: float) -> ScheduledBatch | None:
        """Seat what landed, then decide this iteration; None when nothing can run now. With
        streaming, the batch's first refresh for each receiver streams its K/V: sends to one
        receiver match its receives in posting order, and a transfer's layers are posted
        together, so a second one to the same receiver goes whole after the forward."""
        self.seat_ready()
        if not self.builder.has_work:
            return None
        batch = self.builder.schedule(now)
        if batch.is_empty:
            return None
        if self.streaming:
            dests = set()
            for req in batch.prefills:
                req.streamed = req.kv_dest is not None and req.kv_dest not in dests
                if req.streamed:
                    dests.add(req.kv_dest)
        return batch

    def complete(self, batch: ScheduledBatch, outcomes: list[StepOutcome], start: float,
                 end: float) -> IterationEvents:
        """Apply the forward's ``outcomes`` (one per ``batch.requests``, their cursors already
        moved by it) at ``end``: each request goes back to the builder (seated, waiting for its
        next refresh, or done) or leaves; returns what to report and do."""
        reqs = batch.requests
        stats = IterationStats(batch.prefill_tokens, batch.decode_tokens, batch.deficit,
                               len(reqs), len(batch.prefills), end - start)
        if not batch.prefills and outcomes.count(CONTINUES) == len(reqs):  # most iterations
            self.builder.decodes_stepped(reqs, end)
            return IterationEvents([], [], [], stats)
        refreshed: list[tuple[Request, bool]] = []
        ships: list[Ship] = []
        ended: list[BlockEnded | Failed] = []
        for i in range(len(batch.decodes), len(reqs)):  # the refreshes
            req, o = reqs[i], outcomes[i]
            if o.error is None:
                refreshed.append((req, req.chunk_admitted))
            if req.kv_dest is not None:
                drain = o.error is not None or (o.block_done and not self._continues(req, o))
                if req.streamed or not drain:  # a streamed send is under way: it ends
                    ships.append(Ship(req, _ran(req, o), list(req.pages), drain, req.streamed))
                req.streamed = False
        stepped = []  # decodes whose step did not end their block: most of the batch
        for req, o in zip(reqs, outcomes):
            if o.error is not None:
                self.drop(req.request_id)
                ended.append(Failed(req, o.error))
            elif not o.block_done:
                if req.status is DECODE and req.kv_dest is None:
                    stepped.append(req)
                    continue
                self.builder.step_done(req, end, o)
                if req.kv_dest is not None:  # a refresh for another worker: pages were temporary
                    self.builder.abort(req.request_id)
                    del self.tasks[req.request_id]
            else:
                block = _ran(req, o)
                ended.append(BlockEnded(req, block, o.finished, self._block_done(req, o, end)))
        self.builder.decodes_stepped(stepped, end)
        return IterationEvents(refreshed, ships, ended, stats)

    def seat_ready(self) -> None:
        """Seat landed requests while the builder has room."""
        while self.ready and self.builder.num_seated < self.builder.max_batch_size:
            rid = next(iter(self.ready))
            req = self.ready.pop(rid)
            self.builder.seat(req)
            self.tasks[rid] = req

    @staticmethod
    def _continues(req: Request, outcome: StepOutcome) -> bool:
        """Whether the request's block ended and its next one runs on without being placed:
        it stays here, or starts from cached K/V (by its cadence, no full refresh forced)."""
        return (outcome.block_done and not outcome.finished
                and (req.stays or req.cursor.block_start != FULL_REFRESH))

    def _block_done(self, req: Request, outcome: StepOutcome, now: float) -> list[int] | None:
        """Report ``req``'s step, which ended its block, to the builder; when the next block is
        placed again, return the canvas pages kept here (empty: none kept); None when it
        continues here or on the receiver of this refresh's K/V."""
        rid = req.request_id
        goes_on = self._continues(req, outcome)
        self.builder.step_done(req, now, outcome)
        if req.kv_dest is not None:  # a refresh for another worker: its pages were temporary
            self.builder.abort(rid)
            del self.tasks[rid]
            return None if goes_on else []
        if goes_on:
            return None
        del self.tasks[rid]
        kept: list[int] = []
        if outcome.finished:
            pass  # the builder freed the pages
        elif req.keep_pages:  # park the canvas: the next block's refresh is placed again
            kept = self.builder.detach(rid).pages
            self.parked[rid] = (kept, req.state)
        else:
            self.builder.abort(rid)
        return kept


def _ran(req: Request, outcome: StepOutcome) -> int:
    """The block the forward ran: a block that ended moved the cursor on to the next (step 0)
    unless the request finished with it (a stop string may end it after)."""
    c = req.cursor
    return c.block - 1 if outcome.block_done and c.step == 0 else c.block
