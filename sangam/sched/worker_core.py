"""What one worker keeps of the requests it is given (DESIGN.md §4, Modes): the worker
process (``engine/multi/worker.py``) and the simulator's workers share it, so a simulated
worker takes, seats, parks and drops exactly as a real one does.

A request's work on a worker is one of:
- a whole block (``take_block`` without ``kv_dest``): refresh then cached steps. At the block's
  end the request leaves the builder; its canvas pages and payload stay (``keep_pages``: this
  worker holds the canvas, the request is *parked* until its next block or K/V arrives) or
  are freed;
- a refresh for another worker (``kv_dest`` set): temporary pages for the whole canvas, one
  forward, the K/V sent to ``kv_dest``, pages freed;
- cached steps after a received refresh (``expect_kv``, then ``kv_arrived``): the K/V lands in
  the canvas pages and the request is seated with the state the sender shipped.

A block that starts from cached K/V (its cadence gives it a response-only refresh or none:
``Request.block_start``) is never placed again: it *continues* where the canvas is. The request
stays in the builder after the block before it ends (``step_done`` then returns no pages); a
refresh for another worker that ended its block ships its K/V anyway, and the receiver starts
the next block there (``Task.starts_block``).

Pure Python: ``payload`` is whatever the driver runs a request with (a DecodeState on a real
worker); the driver sends the reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sangam.sampling_params import FULL_REFRESH, NO_REFRESH
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.request import Request


@dataclass
class Task:
    """A request this worker runs (in the builder) or is about to seat."""

    request: Request  # this worker's view of it
    payload: Any  # what the driver runs it with
    attempt: int
    kv_dest: int | None  # a refresh for another worker: its K/V goes there
    keep_pages: bool  # this worker holds the canvas after the block
    # Received K/V of a refresh that ended its block: the request starts its next block here.
    starts_block: bool = False


@dataclass
class Receiving:
    """K/V on its way here; ``pages`` None: drained (no room, dropped meanwhile, or asked)."""

    request_id: str
    attempt: int
    task: Task | None  # what is seated when it lands (None: a drain asked for)
    pages: list[int] | None


class WorkerCore:
    """Invariants: a request is in at most one of ``tasks`` (in the builder), ``ready`` (K/V
    landed, waiting for a seat) and ``parked`` (canvas kept between blocks); every page it
    holds here is in exactly one of them, or in a receive."""

    def __init__(self, builder: BatchBuilder):
        self.builder = builder
        self.allocator = builder.allocator
        self.tasks: dict[str, Task] = {}
        self.ready: dict[str, Task] = {}
        self.parked: dict[str, tuple[list[int], Any]] = {}  # canvas pages, payload
        self.receiving: dict[object, Receiving] = {}

    @property
    def busy(self) -> bool:
        return bool(self.tasks or self.ready or self.receiving)

    def take_block(self, task: Task) -> None:
        """Queue a block's refresh (its canvas, if parked here, refreshes in place)."""
        rid = task.request.request_id
        if rid in self.tasks or rid in self.ready:
            raise RuntimeError(f"{rid!r} is already running here")
        task.request.pages = self.parked.pop(rid, ([], None))[0]
        self.builder.add(task.request)
        self.tasks[rid] = task

    def expect_kv(self, key: object, request_id: str, attempt: int, task: Task | None,
                  num_pages: int) -> None:
        """A refresh's K/V is coming (transfer ``key``), to be seated as ``task``: into the
        parked canvas, or fresh pages if there is room; otherwise (or with no ``task``: a drain
        asked for) it is received and discarded."""
        pages = None
        if task is not None:
            pages = self.parked.pop(request_id, (None,))[0]
            if pages is None and self.allocator.can_allocate(num_pages):
                pages = self.allocator.allocate(num_pages)
        self.receiving[key] = Receiving(request_id, attempt, task, pages)

    def kv_arrived(self, key: object, ok: bool, now: float) -> tuple[Receiving, bool]:
        """Transfer ``key`` ended (``ok``: its data arrived). Returns it, and whether it was
        seated (else its pages are freed)."""
        r = self.receiving.pop(key)
        if ok and r.pages is not None:
            req = r.task.request
            req.pages = r.pages
            if r.task.starts_block and req.block_start != NO_REFRESH:
                self.builder.add(req)  # its response-only refresh runs here
                self.tasks[r.request_id] = r.task
                return r, True
            req.mark_admitted(now)  # the refresh ran on the sender (or: none is due)
            req.mark_step_done(now, block_done=False, finished=False)
            self.ready[r.request_id] = r.task
            return r, True
        if r.pages is not None:
            self.allocator.free(r.pages)
        return r, False

    def drop(self, request_id: str) -> None:
        """Forget a request and free whatever it holds here; a receive in progress drains."""
        task = self.ready.pop(request_id, None)
        if task is not None:
            self.allocator.free(task.request.pages)
        if self.tasks.pop(request_id, None) is not None:
            self.builder.abort(request_id)  # frees its pages
        pages = self.parked.pop(request_id, ([], None))[0]
        if pages:
            self.allocator.free(pages)
        for r in self.receiving.values():
            if r.request_id == request_id and r.pages is not None:
                self.allocator.free(r.pages)
                r.pages = None

    def parked_payload(self, request_id: str) -> Any:
        """What a parked request was last run with (its next block starts from it)."""
        if request_id not in self.parked:
            raise RuntimeError(f"{request_id!r} is not parked here")
        return self.parked[request_id][1]

    def seat_ready(self) -> None:
        """Seat landed requests while the builder has room."""
        while self.ready and self.builder.num_seated < self.builder.max_batch_size:
            rid = next(iter(self.ready))
            task = self.ready.pop(rid)
            self.builder.seat(task.request)
            self.tasks[rid] = task

    @staticmethod
    def continues(req: Request, block_done: bool, finished: bool,
                  force_refresh: bool = False) -> bool:
        """Whether ``req``'s block ended and its next one starts from cached K/V (its cadence
        says so, and no full refresh is forced), so it continues where the canvas is (call
        before ``step_done``)."""
        return (block_done and not finished and not force_refresh
                and req.block_refresh(req.block + 1) != FULL_REFRESH)

    def step_done(self, req: Request, now: float, block_done: bool, finished: bool,
                  finish_reason: str | None = None,
                  force_refresh: bool = False) -> tuple[Task, list[int] | None]:
        """After a forward: ``req``'s step is reported to the builder, and its task and, when
        its block ended and the next is placed again, the canvas pages kept here (an empty
        list: none kept) are returned; None while the block goes on, or when the next block
        continues (``continues``) here or on the receiver of this refresh's K/V."""
        rid = req.request_id
        task = self.tasks[rid]
        goes_on = self.continues(req, block_done, finished, force_refresh)
        self.builder.step_done(req, now, block_done, finished, finish_reason, force_refresh)
        if task.kv_dest is not None:  # a refresh for another worker: its pages were temporary
            self.builder.abort(rid)
            del self.tasks[rid]
            return task, [] if block_done and not goes_on else None
        if not block_done or goes_on:
            return task, None
        del self.tasks[rid]
        kept: list[int] = []
        if finished:
            pass  # the builder freed the pages
        elif task.keep_pages:  # park the canvas: the next block's refresh is placed again
            kept = self.builder.detach(rid).pages
            self.parked[rid] = (kept, task.payload)
        else:
            self.builder.abort(rid)
        return task, kept
