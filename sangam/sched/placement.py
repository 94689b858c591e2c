"""Placement: where each block of each request runs, when its K/V moves, and what a failure
takes back, in every mode (docs/design.md §4). The multi-worker front and the simulator drive this
one object; each turns its decisions into its own actions (messages to worker processes;
events of a simulated clock).

A request's life here, one block at a time:

    pending --place--> running on ``worker`` (its refresh; and, with no ``kv_dest``, the whole
       ^               block there, on the canvas when ``keep``)
       |                  | refresh sent its K/V to ``kv_dst``      | block done
       |                  v                                         |
       |               transfer (``kv_src`` -> ``kv_dst``) --received--> running on the holder
       |                                                            |
       +--------------- block done (not finished) ------------------+----> finished: removed
    failure (dead worker, failed transfer) -> back to pending at its block's start

Who runs what:
- colocated: each block runs where its canvas is (the router keeps re-prefills there), so a
  request is placed once and its later blocks continue there (``Dispatch.stays``; their
  refreshes still count as the worker's load); a new request goes to the least-loaded worker.
- disaggregated / hybrid: a new canvas is placed on the decode worker with the most free pages
  (``Router.route_decode``); a request that finds none waits, and blocks the new canvases
  behind it (strict priority: blocks of requests that hold a canvas never wait for memory).
  Each block's refresh goes to a prefill worker by load, which ships the K/V to the canvas
  holder, where the cached steps run. Hybrid overflow (``route_prefill`` gives a decode
  worker) runs the whole block there, on its canvas, with nothing to ship.
- ``cache="none"`` in disaggregated / hybrid mode: every step is a refresh, so there is no
  cache worth shipping: each block runs whole where ``route_prefill`` puts it, on pages held
  for that block only.
- A block whose cadence starts it from cached K/V (a response-only refresh, or none) is not
  placed: it continues on the canvas holder (``block_continued``), where the prompt's K/V is.
  Only full refreshes are placed. A request taken back (``_restart``) has lost its cache, so
  its block is placed for a full refresh whatever the cadence says (``BlockCursor.lose_cache``).
- Failover: while workers of only one role survive (``Router.one_role_left``) they serve as
  colocated workers do. With none left, placing raises.

The front keeps each request's cursor at the start of its next block (the workers report
their progress); Placement moves it only when it takes a request back.

Memory: every worker's page commitments (canvases held or promised, pages of refreshes for
other workers) are mirrored here, so the router's free-page counts do not lag behind the
workers' own reports.

Invariants: ``committed[w]`` is the sum of the footprints of the requests placed on ``w``;
a request is in ``pending`` iff its phase is PENDING; an event about another attempt of a
request (``attempt`` changes whenever it is taken back) is never applied.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sangam.sched.block_cursor import FULL_REFRESH, NO_REFRESH, BlockCursor
from sangam.sched.config import DeploymentConfig
from sangam.sched.request import RequestMetrics, creation_order
from sangam.sched.router import Router

PENDING = "pending"  # waiting to be placed
RUNNING = "running"  # ``worker`` runs this block's refresh (and, without kv_dst, the block)
TRANSFER = "transfer"  # the refresh's K/V travels from kv_src to kv_dst


class NeverFits(ValueError):
    """A request whose canvas no live worker's pool can ever hold."""


@dataclass(eq=False)
class Placed:
    """The front's one record of a request: who it is, where it stands (its cursor, at the
    start of the block it runs next), where it is placed, its timeline as users see it, and
    what its driver keeps of it (``state``: the engine's decode state, the simulator's draws;
    Placement never reads it)."""

    request_id: str
    arrival_time: float
    cursor: BlockCursor
    pages_needed: int
    attempt: int  # unique over the placement's life: a reused request id never matches old news
    priority: int = 0  # vLLM's: lower is served first; ties by arrival
    seq: int = 0  # its place among equal arrivals (creation order), kept by the workers' copies
    state: Any = None
    prompt_ids: list[int] | None = None
    phase: str = PENDING
    worker: int | None = None
    holder: int | None = None  # holds (or, once admitted there, will hold) the canvas
    reserved: int | None = None  # decode worker promised the canvas on K/V receipt
    kv_src: int | None = None
    kv_dst: int | None = None
    load_worker: int | None = None  # router load outstanding there...
    load_tokens: int = 0  # ... this many tokens (what route_prefill charged)
    restarts: int = 0
    # The worker that parked the canvas with its own copy of ``state`` (it ended the last block
    # there and has not been sent the request since): it is sent no state, only progress.
    parked_on: int | None = None
    kv_bytes: int = 0
    kv_transfers: int = 0
    cached_tokens: int = 0  # prompt tokens its current attempt found in a prefix cache
    text: Any = None  # the engine's detokenizer of its outputs (read on the caller's thread)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time, prefill_queued=[self.arrival_time])

    @property
    def queue_key(self) -> tuple[int, float, int]:
        """Placing order, smaller first: priority, then original arrival, then creation
        order (``Request.queue_key``, which the workers' copies keep)."""
        return (self.priority, self.arrival_time, self.seq)

    # Its timeline as the workers report it (the only writers of ``metrics`` on the front).
    def mark_refreshed(self, start: float, end: float, chunk: bool = False) -> None:
        """A refresh ran from ``start`` to ``end`` (``chunk``: a chunk of it; the rest waits
        again)."""
        m = self.metrics
        m.prefill_started.append(start)
        m.prefill_finished.append(end)
        (m.prefill_queued if chunk else m.decode_started).append(end)

    def mark_block_done(self, now: float, forwards: int, finished: bool) -> None:
        """A block ended at ``now`` (``forwards`` spent so far), the cursor at the next block;
        ``finished``: the request ended there."""
        m = self.metrics
        m.block_finished.append(now)
        m.num_steps = forwards
        if finished:
            m.finish_time = now
        elif self.cursor.block_start == NO_REFRESH:
            m.decode_started.append(now)
        else:
            m.prefill_queued.append(now)


@dataclass(frozen=True)
class Dispatch:
    """Run the next block's refresh of a request on ``worker``: with ``kv_dest`` None the
    whole block (keeping the canvas there afterwards when ``keep_pages``; with ``stays`` every
    later block runs there too, without being placed), else the refresh only, its K/V then
    sent to ``kv_dest``."""

    request_id: str
    attempt: int
    worker: int
    kv_dest: int | None
    keep_pages: bool
    stays: bool = False


@dataclass
class PlacementCounters:
    overflow_prefills: int = 0  # hybrid: prefills placed on decode workers
    failed_transfers: int = 0
    restarts: int = 0  # requests taken back to their block start
    prefills_by_worker: dict[int, int] = field(default_factory=dict)


class Placement:
    def __init__(self, deployment: DeploymentConfig, num_pages: Sequence[int]):
        """``num_pages``: each worker's KV pool."""
        self.mode = deployment.mode
        self.roles = list(deployment.roles)
        if len(num_pages) != len(self.roles):
            raise ValueError(f"{len(num_pages)} pool sizes for {len(self.roles)} workers")
        self.num_pages = list(num_pages)
        self.page_size = deployment.scheduler.page_size
        self.router = Router.for_deployment(deployment)
        self.counters = PlacementCounters()
        self.requests: dict[str, Placed] = {}
        self.pending: dict[str, Placed] = {}
        self.committed = [0] * len(self.roles)
        self.dead: list[int] = []
        self._attempts = itertools.count()

    # Requests in and out.
    def room(self) -> int:
        """The largest canvas, in pages, that the live workers can serve now."""
        def biggest(workers: list[int]) -> int:
            return max((self.num_pages[w] for w in workers), default=0)

        return min(biggest(self.router.prefill_capable()), biggest(self.router.canvas_capable()))

    def add(self, request_id: str, arrival_time: float, cursor: BlockCursor, *,
            priority: int = 0, seq: int | None = None, state: Any = None,
            prompt_ids: list[int] | None = None) -> Placed:
        """A new request, pending; NeverFits if no live worker could ever hold its canvas."""
        need = cursor.num_pages(self.page_size)
        if need > self.room():
            raise NeverFits(f"request needs {need} KV pages for {cursor.total_len} tokens, "
                            f"more than the pool's {self.room()}")
        placed = Placed(request_id, arrival_time, cursor, need, next(self._attempts), priority,
                        creation_order() if seq is None else seq, state, prompt_ids)
        self.requests[request_id] = placed
        self.pending[request_id] = placed
        return placed

    def remove(self, request_id: str) -> set[int]:
        """Forget a request (aborted, failed); returns the live workers that may hold part of
        it (to be told to drop it)."""
        placed = self.requests.pop(request_id)
        self.pending.pop(request_id, None)
        return self._release(placed)

    def current(self, request_id: str, attempt: int) -> Placed | None:
        """The request, if ``attempt`` is its current one (news about abandoned work: None)."""
        placed = self.requests.get(request_id)
        return placed if placed is not None and placed.attempt == attempt else None

    # Placing.
    def place(self) -> list[Dispatch]:
        """Place every pending block that can be placed now, in priority order."""
        if not self.pending:
            return []
        out = []
        blocked = False
        for placed in sorted(self.pending.values(), key=lambda p: p.queue_key):
            # A new canvas that finds no decode memory blocks later new canvases (strict
            # priority); blocks of requests that hold their canvas never wait for memory.
            needs_canvas = placed.holder is None and self.mode != "colocated" \
                and placed.cursor.cache != "none" and not self.router.one_role_left
            dispatch = None if blocked and needs_canvas else self._place(placed)
            if dispatch is None:
                blocked = blocked or needs_canvas
                continue
            del self.pending[placed.request_id]
            out.append(dispatch)
        return out

    def _place(self, p: Placed) -> Dispatch | None:
        free = self.free_pages()
        cache = p.cursor.cache
        if self.mode == "colocated" or (self.router.one_role_left and cache != "none"):
            w = self.router.route_prefill(p, free)  # the holder, once it holds the canvas
            return self._dispatch(p, w, None, keep=True, holder=w, stays=True)
        if cache == "none":
            return self._dispatch(p, self.router.route_prefill(p, free), None, keep=False)
        dest = p.holder
        if dest is None:
            dest = self.router.route_decode(p, free)
            if dest is None:
                return None
        w = self.router.route_prefill(p, free)
        if self.roles[w] == "decode":  # hybrid overflow: the block runs on its canvas
            self.counters.overflow_prefills += 1
            return self._dispatch(p, w, None, keep=True, holder=w)
        return self._dispatch(p, w, dest, keep=False, holder=p.holder,
                              reserved=dest if p.holder is None else None)

    def _dispatch(self, p: Placed, w: int, kv_dest: int | None, keep: bool,
                  holder: int | None = None, reserved: int | None = None,
                  stays: bool = False) -> Dispatch:
        with self._moving(p):
            p.phase, p.worker, p.holder, p.reserved = RUNNING, w, holder, reserved
            p.load_worker, p.load_tokens = w, p.cursor.span_len  # as route_prefill did
        self._count_prefill(w)
        return Dispatch(p.request_id, p.attempt, w, kv_dest, keep, stays)

    def _count_prefill(self, w: int) -> None:
        c = self.counters.prefills_by_worker
        c[w] = c.get(w, 0) + 1

    # What the workers report.
    def refreshed(self, p: Placed, worker: int, start: float, end: float,
                  chunk: bool = False) -> None:
        """The block's refresh forward ran on ``worker`` from ``start`` to ``end``: its tokens
        leave the load (``chunk``: only a chunk of it ran; the rest is still to come)."""
        if p.load_worker == worker and not chunk:
            self.router.done(worker, p.load_tokens)
            p.load_worker = None
        p.mark_refreshed(start, end, chunk)

    def kv_sent(self, p: Placed | None, src: int, dest: int, drain: bool) -> bool:
        """``src`` posted a transfer to ``dest`` for ``p`` (None: for work taken back). Returns
        whether the receiver is to discard it (the request is gone or abandoned, or the
        refresh completed its block, ``drain``); otherwise the K/V is on its way."""
        if p is None or drain:
            return True
        with self._moving(p):
            p.phase, p.worker, p.kv_src, p.kv_dst = TRANSFER, None, src, dest
        return False

    def kv_received(self, p: Placed, dst: int, ok: bool, pages: list[int]) -> set[int]:
        """The K/V landed on ``dst`` (``ok``: seated, holding ``pages``), or could not be taken
        (the block is taken back and placed again: the live workers to tell to drop it)."""
        if not ok:
            self.counters.failed_transfers += 1
            return self._restart(p)
        with self._moving(p):
            p.phase, p.worker, p.holder, p.reserved = RUNNING, dst, dst, None
            p.kv_src = p.kv_dst = None
        return set()

    def block_done(self, p: Placed, worker: int, finished: bool, forwards: int,
                   pages: list[int], now: float) -> set[int]:
        """A block of ``p`` completed on ``worker`` at ``now`` (``forwards`` spent so far; the
        request's cursor at its next block), which keeps ``pages`` of its canvas (none: it
        freed them). Unfinished, the next block waits to be placed; finished, the request is
        removed. Returns the live workers, other than ``worker``, that still hold some of it
        (to be told to drop it)."""
        rid = p.request_id
        p.mark_block_done(now, forwards, finished)
        if finished:
            stale = {p.holder, p.kv_dst} - {None, worker}
            with self._moving(p):
                p.phase, p.worker, p.holder, p.reserved = PENDING, None, None, None
            del self.requests[rid]
            return {w for w in stale if w not in self.dead}
        with self._moving(p):
            p.phase, p.worker, p.reserved = PENDING, None, None
            if pages:
                p.holder = worker
        self.pending[rid] = p
        return set()

    def block_continued(self, p: Placed, forwards: int, now: float) -> None:
        """A block of ``p`` completed at ``now`` and the next (the request's cursor is there)
        runs on without being placed: it starts from cached K/V (its cadence), on the canvas
        holder or on its way there, or its request stays where it is (``Dispatch.stays``), whose
        next full refresh counts as that worker's load as a placed one would."""
        p.mark_block_done(now, forwards, finished=False)
        if p.cursor.block_start == FULL_REFRESH and p.worker is not None:  # stays: as if placed
            p.load_worker, p.load_tokens = p.worker, p.cursor.span_len
            self.router.add(p.worker, p.load_tokens)
            self._count_prefill(p.worker)

    def worker_dead(self, w: int) -> list[tuple[Placed, set[int]]]:
        """``w`` is gone: every request with anything on it is taken back to its block's start
        (and placed again). Returns each of those, with the live workers to tell to drop it.
        Raises when no worker is left."""
        self.dead.append(w)
        self.router.mark_dead(w)
        if len(self.dead) == len(self.roles):
            raise RuntimeError("every worker is dead")
        return [(p, self._restart(p)) for p in list(self.requests.values())
                if w in (p.worker, p.holder, p.reserved, p.kv_src, p.kv_dst)]

    def worker_rejoined(self, w: int, num_pages: int) -> None:
        """Dead worker ``w`` serves again: a new process with an empty pool of ``num_pages``
        (nothing was left on it: ``worker_dead`` took everything back)."""
        if w not in self.dead:
            raise ValueError(f"worker {w} is not dead")
        self.dead.remove(w)
        self.router.revive(w)
        self.num_pages[w] = num_pages

    # Internals.
    def free_pages(self) -> list[int]:
        return [0 if w in self.dead else self.num_pages[w] - self.committed[w]
                for w in range(len(self.roles))]

    def _footprint(self, p: Placed) -> list[tuple[int, int]]:
        canvas = p.holder if p.holder is not None else p.reserved
        out = [] if canvas is None else [(canvas, p.pages_needed)]
        if p.phase == RUNNING and p.worker != canvas:  # pages for this block only
            out.append((p.worker, p.pages_needed))
        return out

    @contextlib.contextmanager
    def _moving(self, p: Placed) -> Iterator[None]:
        """Keep the page mirror in step with the request's placement fields."""
        for w, n in self._footprint(p):
            self.committed[w] -= n
        yield
        for w, n in self._footprint(p):
            self.committed[w] += n

    def _release(self, p: Placed) -> set[int]:
        """Clear ``p``'s placement; the live workers that may hold part of it."""
        drops = {w for w in (p.worker, p.holder, p.kv_dst) if w is not None and w not in self.dead}
        if p.load_worker is not None:
            self.router.done(p.load_worker, p.load_tokens)
        with self._moving(p):
            p.phase = PENDING
            p.worker = p.holder = p.reserved = p.kv_src = p.kv_dst = p.load_worker = None
        p.parked_on = None
        return drops

    def _restart(self, p: Placed) -> set[int]:
        """Take ``p`` back to the start of its current block, to be placed again."""
        drops = self._release(p)
        p.cursor.lose_cache()  # whatever K/V it had is gone or discarded
        p.attempt = next(self._attempts)
        p.restarts += 1
        self.counters.restarts += 1
        self.pending[p.request_id] = p
        return drops
