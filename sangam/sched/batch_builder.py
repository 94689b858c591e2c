"""Per-worker batch builder: which requests share the next forward (docs/design.md §4).

Pure Python, no tensors, no model: the engine and the simulator call the same methods in the
same order, once per iteration::

    batch = builder.schedule(now)          # decide this iteration
    ... one forward over batch.prefills (refreshes) and batch.decodes (cached steps),
        which moves each request's cursor ...
    builder.step_done(req, now, outcome)   # once for every request of the batch

Policies (``SchedulerConfig.policy``):
- ``deficit``: the deficit token budget of docs/design.md §4 (Deficit Round-Robin over prefill
  tokens). Seated decodes always run; waiting prefills are admitted in queue order (the
  request's ``priority``, lower first, then original arrival: ``Request.queue_key``), strict
  head-of-line, while their cost fits ``(tau - decode_tokens) + deficit``; unused budget carries
  over, so a prefill larger than ``tau`` is admitted after enough iterations. With
  ``chunked_prefill``, a block-causal head (SDAR) whose prefill exceeds what is left is
  admitted in part instead: its prompt's whole blocks up to the budget, one chunk per
  iteration, the rest (with its first block) when the budget covers it.
- ``prefill_first``: ``tau`` = infinity: every waiting prefill that fits memory and the batch cap
  is admitted, head-of-line (Orca / vLLM / dLLM-Serve).
- ``fastdllm``: batch size 1 (the Fast-dLLM baseline): one request at a time, run to
  completion; its own re-prefills run immediately; when it finishes the next is admitted.
- ``adaptive``: ``deficit`` with tau set every iteration from what the worker holds: the
  larger of ``token_budget`` (a floor) and the waiting prefill tokens weighted by the queue's
  share of the worker's requests (waiting / (waiting + seated)), over ``drain_iterations``.
  A prefill stalls every seated decode while a wait delays only the waiting, so a queue that
  outgrows the decodes raises the budget toward prefill-first and a short one, behind many
  decodes, keeps the floor that protects them. Scheduling only: tokens never change.

Memory: a request's pages for the whole canvas (``ceil(T / page_size)``) are allocated at its
first admission and freed when it finishes or is aborted; re-prefills hold them already, so
nothing is ever preempted. A head that cannot get its pages blocks admission ("memory-blocked")
and the iteration banks no budget. With a prefix cache (block-causal models), a head's first
pages may be cached ones, shared: its prefill starts after them and costs only what it computes;
a head whose prefix reaches pages another prefill of this iteration computes waits for the next
iteration and then shares them (the iteration banks no budget either). With a hybrid pool's
``rings`` (``window_rings.py``), a request also takes a ring of sliding-window pages at its first
admission, and no forward of it spans more than the rings allow: a longer prefill is admitted in
chunks of whole blocks.

Not thread-safe: the driver serializes calls.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from sangam.sched.config import SchedulerConfig
from sangam.sched.page_allocator import PageAllocator
from sangam.sched.prefix_cache import PrefixCache
from sangam.sched.request import CONTINUES, Request, RequestStatus, StepOutcome
from sangam.sched.window_rings import WindowRings


@dataclass
class ScheduledBatch:
    """One iteration's work. A request appears in at most one of the two lists."""

    prefills: list[Request]  # admitted this iteration (status PREFILL): one refresh each
    decodes: list[Request]  # seated (status DECODE): one cached step each
    prefill_tokens: int  # sum of the prefills' spans (T each)
    decode_tokens: int  # sum of the decodes' spans
    deficit: int  # carried budget after this iteration
    memory_blocked: bool  # the head of the queue could not get its pages
    idle_admission: bool  # a prefill was admitted by the idle rule, over the budget
    # Every request of the batch, in the order the forward packs them: decodes first.
    requests: list[Request] = field(init=False)

    def __post_init__(self) -> None:
        self.requests = self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.requests


class BatchBuilder:
    """Schedules one worker's requests over its page allocator.

    Invariants between calls (after ``step_done`` was called for the whole last batch):
    - every request held here is in exactly one place, by status: WAITING -> the queue,
      DECODE -> the seats; PREFILL exists only between ``schedule`` and ``step_done``;
    - a request holding pages is WAITING (a re-prefill) or DECODE; pages are freed exactly
      once, when it finishes or is aborted; under a hybrid pool it holds one ring with them,
      and no forward of it spans more than ``rings.shape.max_span``;
    - ``deficit >= 0``; it is 0 with an infinite budget and after an iteration with nothing
      waiting;
    - ``num_seated <= max_batch_size``;
    - ``waiting_tokens`` is the sum of the WAITING requests' ``prefill_cost``;
      ``num_load_adaptive`` counts the held requests with ``load_adaptive``.
    """

    def __init__(self, allocator: PageAllocator, config: SchedulerConfig,
                 prefix_cache: PrefixCache | None = None, rings: WindowRings | None = None):
        if rings is not None and prefix_cache is not None:
            raise ValueError("a hybrid pool's rings keep no prefix a cache could share")
        self.allocator = allocator
        self.prefix_cache = prefix_cache  # over allocator's pages; None: no prefix caching
        self.rings = rings  # a hybrid pool's sliding-window pages; None: one pool
        self.config = config
        self.page_size = config.page_size
        self.policy = config.policy
        self.token_budget: int | float = config.budget  # tau (adaptive: its floor)
        self.max_batch_size = config.batch_cap
        self._deficit = 0
        self._requests: dict[str, Request] = {}  # every request held here, any status
        self._waiting: dict[str, Request] = {}  # status WAITING
        self._waiting_tokens = 0  # sum of their prefill costs
        # Requests held whose thresholds follow this worker's load (the driver sets them only
        # when there are any: it is the one per-request pass it would make for them).
        self.num_load_adaptive = 0
        # Heap of (queue_key, request) over the WAITING requests. An entry whose request is no
        # longer in _waiting (aborted) is stale and dropped when it reaches the top.
        # (queue key, push count, request): the count orders a request re-queued while a stale
        # entry of its own (same key) is still in the heap, and never compares requests.
        self._queue: list[tuple[tuple[int, float, int], int, Request]] = []
        self._pushes = itertools.count()
        self._seated: dict[str, Request] = {}  # status DECODE, in seating order
        self._in_flight: dict[str, Request] = {}  # scheduled, step_done not yet called
        self._active: Request | None = None  # fastdllm: the one request being served
        self._now = -math.inf  # latest time given to schedule / step_done

    # State.
    @property
    def deficit(self) -> int:
        return self._deficit

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def load(self) -> float:
        """How full this worker is, 0 to 1: the requests it holds besides one, over
        ``max_batch_size`` (what lowers a load-adaptive request's threshold)."""
        return min(1.0, max(0, len(self._requests) - 1) / self.max_batch_size)

    @property
    def waiting_tokens(self) -> int:
        """Prefill tokens queued: the sum of the waiting requests' refresh spans."""
        return self._waiting_tokens

    def current_budget(self) -> int | float:
        """This iteration's tau: ``token_budget``, or for ``adaptive`` the larger of it and the
        waiting prefill tokens times the queue's share of the requests, over
        ``drain_iterations``."""
        if self.policy != "adaptive":
            return self.token_budget
        waiting = len(self._waiting)
        share = self._waiting_tokens * waiting // max(1, waiting + len(self._seated))
        return max(self.token_budget, -(-share // self.config.drain_iterations))

    @property
    def num_seated(self) -> int:
        return len(self._seated)

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    def fits_ever(self, req: Request) -> bool:
        """Whether ``req``'s canvas (and ring) fits the pool at all; check at submission."""
        rings = self.rings
        return (req.cursor.num_pages(self.page_size) <= self.allocator.num_pages
                and (rings is None or rings.shape.pages <= rings.allocator.num_pages))

    # Driver calls.
    def add(self, req: Request) -> None:
        """Queue a WAITING request: a new one, or one that already holds pages of this pool.

        A re-prefill that went through ``step_done`` is re-queued there: do not add it again.
        """
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"add: {req!r} is not WAITING")
        if req.request_id in self._requests:
            raise ValueError(f"add: request id {req.request_id!r} is already scheduled here")
        if not req.pages and not self.fits_ever(req):
            raise ValueError(
                f"request {req.request_id!r} can never fit: its {req.cursor.total_len} positions "
                f"need {req.cursor.num_pages(self.page_size)} KV pages of {self.page_size} tokens, "
                f"the pool has {self.allocator.num_pages}")
        self._hold(req)
        self._enqueue(req)

    def schedule(self, now: float) -> ScheduledBatch:
        """Decide this iteration; admitted prefills are marked admitted and hold their pages."""
        if self._in_flight:
            raise RuntimeError(f"schedule() before step_done() of {list(self._in_flight)}")
        self._now = now
        if self.policy == "fastdllm":
            batch = self._schedule_one(now)
        else:
            batch = self._schedule_budget(now)
        for r in batch.prefills:
            self._in_flight[r.request_id] = r
        for r in batch.decodes:
            self._in_flight[r.request_id] = r
            if r.page_keys is not None and not r.cursor.step:
                # A block's first step stores the block before it final: its pages join the
                # cache (the prefix a conversation's next turn starts with).
                self._publish(r, r.cursor.block_bounds()[0])
        return batch

    def step_done(self, req: Request, now: float, outcome: StepOutcome) -> None:
        """Report ``req``'s forward of the last batch (see ``Request.mark_step_done``).

        A request aborted since ``schedule`` is ignored: its result is simply dropped.
        """
        if req.finish_reason == "abort" and req.request_id not in self._requests:
            return
        if self._in_flight.pop(req.request_id, None) is not req:
            raise ValueError(f"step_done: {req!r} is not in the last scheduled batch")
        self._now = now
        if req.pending_pages:  # the forward that made them final ran (a failed one ends its
            self.prefix_cache.ready(req.pending_pages)  # request: they go with its pages)
            req.pending_pages = []
        req.mark_step_done(now, outcome)
        if req.status is RequestStatus.FINISHED:
            self._release(req)
        elif req.status is RequestStatus.WAITING:  # next block's re-prefill, same priority
            self._seated.pop(req.request_id, None)
            self._enqueue(req)
        else:  # DECODE: (stays) seated; a fresh prefill runs its first cached step next time
            self._seated[req.request_id] = req

    def decodes_stepped(self, reqs: list[Request], now: float) -> None:
        """``step_done`` of seated decodes (status DECODE) of the last batch whose step did not
        end their block (the common case, in one call): they stay seated."""
        in_flight = self._in_flight
        self._now = now
        for req in reqs:
            if req.pending_pages or in_flight.pop(req.request_id, None) is not req:
                self.step_done(req, now, CONTINUES)  # (which raises for a stranger)
            else:
                req.metrics.num_steps += 1

    def abort(self, request_id: str, now: float | None = None) -> Request | None:
        """Remove a request wherever it is, free its pages, mark it aborted; None if unknown.

        ``now`` defaults to the latest time this builder was given (or the arrival time).
        """
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._release(req)
        req.mark_aborted(max(self._now, req.arrival_time) if now is None else now)
        return req

    # Multi-worker serving: a request's blocks may run on different workers.
    def seat(self, req: Request) -> None:
        """Seat a request whose refresh ran on another worker (disaggregated serving): it is
        DECODE, holds its pages of this pool, and runs its first cached step next iteration."""
        if req.status is not RequestStatus.DECODE or not req.pages:
            raise ValueError(f"seat: {req!r} must be DECODE and hold pages")
        if req.request_id in self._requests:
            raise ValueError(f"seat: request id {req.request_id!r} is already scheduled here")
        if self.policy == "fastdllm" or len(self._seated) >= self.max_batch_size:
            raise ValueError(f"seat: no free seat for {req!r}")
        self._hold(req)
        self._seated[req.request_id] = req

    def detach(self, request_id: str) -> Request | None:
        """Forget a request without freeing its pages, which pass to the caller (multi-worker
        serving: the next block's re-prefill is routed again while the canvas stays in this
        pool). None if unknown; raises while it is in the last scheduled batch."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if request_id in self._in_flight:
            raise ValueError(f"detach: {req!r} is in the last scheduled batch")
        if req.window_pages:  # (the hybrid pool serves colocated workers only)
            raise ValueError(f"detach: {req!r} holds a ring, which does not park")
        pages, req.pages = req.pages, []
        self._release(req)
        req.pages = pages
        return req

    # Policies.
    def _schedule_budget(self, now: float) -> ScheduledBatch:
        """docs/design.md §4's deficit token budget; ``tau = inf`` gives prefill-first."""
        decodes = list(self._seated.values())
        decode_tokens = sum(r.cursor.decode_span for r in decodes)
        prefills: list[Request] = []
        head = self._head()
        if head is None:  # nothing waiting: the deficit resets (DRR)
            self._deficit = 0
            return ScheduledBatch(prefills, decodes, 0, decode_tokens, 0, False, False)
        tau = self.current_budget()
        fresh = tau - decode_tokens  # this iteration's own prefill budget; may be < 0
        remaining = fresh + self._deficit
        admitted = 0
        idle = memory_blocked = batch_full = False
        while head is not None:
            if len(decodes) + len(prefills) >= self.max_batch_size:
                batch_full = True
                break
            stored = head.cursor.prefilled  # what a look-up not taken up leaves it at
            hit = self._look_up(head)
            if hit is None:  # its prefix is being computed in this batch: share it next time
                batch_full = True
                break
            by_budget = head.cursor.span_len <= remaining - admitted
            chunk = 0
            if not by_budget and (decodes or prefills):
                if self.config.chunked_prefill:
                    chunk = head.cursor.chunk_room(remaining - admitted)
                if not chunk:
                    self._set_prefilled(head, stored)
                    break  # strict head-of-line: nothing behind it may leapfrog
            chunk = self._within_span(head, chunk)
            if not head.pages and not self._take_pages(head, hit):
                memory_blocked = True
                break
            heapq.heappop(self._queue)
            self._admit(head, now, prefills, chunk)
            if chunk:  # part of the head's prefill; what follows it waits behind the rest
                admitted += chunk
                break
            admitted += head.cursor.span_len
            idle = idle or not by_budget  # the idle rule: never leave the GPU idle
            head = self._head()
        if memory_blocked and not decodes and not prefills:
            # Liveness: the head waits for pages that only queued re-prefills hold (possible
            # when a request is added with an older arrival time than admitted ones). Run the
            # first of them, as the idle rule would; it needs no allocation.
            holder = self._first_holding_pages()
            if holder is not None:
                self._queue = [e for e in self._queue if e[2] is not holder]
                heapq.heapify(self._queue)
                chunk = self._within_span(holder, 0)
                self._admit(holder, now, prefills, chunk)
                admitted += chunk or holder.cursor.span_len
                idle = True
        if math.isinf(tau):
            self._deficit = 0
        elif memory_blocked or batch_full:
            # Blocked by something other than the budget: bank none of this iteration's budget,
            # and charge the old deficit only for what was admitted beyond the fresh budget.
            self._deficit = max(0, self._deficit - max(0, admitted - fresh))
        else:
            self._deficit = max(0, remaining - admitted)
        return ScheduledBatch(prefills, decodes, admitted, decode_tokens, self._deficit,
                              memory_blocked, idle)

    def _schedule_one(self, now: float) -> ScheduledBatch:
        """Fast-dLLM baseline: the active request alone until it finishes."""
        prefills: list[Request] = []
        decodes: list[Request] = []
        memory_blocked = False
        act = self._active
        if act is None:
            head = self._head()
            if head is not None:
                hit = self._look_up(head) or []  # nothing else runs: never a pending page
                if head.pages or self._take_pages(head, hit):
                    heapq.heappop(self._queue)
                    self._admit(head, now, prefills, self._within_span(head, 0))
                    self._active = head
                else:
                    memory_blocked = True
        elif act.status is RequestStatus.WAITING:  # its own re-prefill runs at once
            self._admit(act, now, prefills, self._within_span(act, 0))
        else:
            decodes.append(act)
        return ScheduledBatch(prefills, decodes, sum(r.cursor.span_len for r in prefills),
                              sum(r.cursor.decode_span for r in decodes), 0, memory_blocked, False)

    def _within_span(self, req: Request, chunk: int) -> int:
        """``chunk`` (0: the whole prefill), cut so that the forward spans at most the
        hybrid pool's ``max_span`` positions: whole blocks of the prompt, 0 when it fits."""
        if self.rings is None:
            return chunk
        limit = self.rings.shape.max_span
        if chunk:
            return min(chunk, req.cursor.chunk_room(limit))
        # A span beyond the limit is always a prompt's (a later block's first step spans two
        # blocks, within it); were it not, the runner refuses the forward (window_arrays).
        return req.cursor.chunk_room(limit) if req.cursor.span_len > limit else 0

    # Queue.
    def _enqueue(self, req: Request) -> None:
        self._waiting[req.request_id] = req
        self._waiting_tokens += req.cursor.span_len
        if req is not self._active:  # fastdllm's active re-prefill bypasses the queue
            heapq.heappush(self._queue, (req.queue_key, next(self._pushes), req))

    def _head(self) -> Request | None:
        """The highest-priority WAITING request, dropping stale entries on the way."""
        q = self._queue
        while q:
            req = q[0][2]
            if self._waiting.get(req.request_id) is req:
                return req
            heapq.heappop(q)
        return None

    def _first_holding_pages(self) -> Request | None:
        holders = [r for r in self._waiting.values() if r.pages]
        return min(holders, key=lambda r: r.queue_key, default=None)

    def _admit(self, req: Request, now: float, prefills: list[Request], chunk: int = 0) -> None:
        """``req`` has left the heap (or never was in it) and holds its pages; ``chunk``: only
        that many tokens of its prefill are admitted."""
        del self._waiting[req.request_id]
        self._waiting_tokens -= req.cursor.span_len
        req.mark_admitted(now, chunk)
        prefills.append(req)
        if req.page_keys is not None:
            # This forward stores the prompt's whole blocks (a chunk's, or all of them).
            c = req.cursor
            self._publish(req, c.block_origin if c.chunk_end is None else c.chunk_end)

    # Prefix caching.
    def _publish(self, req: Request, final_end: int) -> None:
        """The scheduled forward makes ``req``'s K/V of [0, final_end) final: its pages there
        not yet published are, pending until the forward ran."""
        final = min(len(req.page_keys), final_end // self.page_size)
        if final > req.published:
            req.pending_pages = self.prefix_cache.publish(
                req.page_keys[req.published:final], req.pages[req.published:final])
            req.published = final

    def _look_up(self, req: Request) -> list[int] | None:
        """For a head about to get its pages (its first admission: nothing of its prompt
        stored): the cached pages its prompt starts with (their tokens set as prefilled, its
        cost now what is left), or None when the page after them is pending in this batch."""
        if req.pages or not req.page_keys or self.prefix_cache is None:
            return []
        pages, pending = self.prefix_cache.match(req.page_keys)
        if pending:
            return None
        # Prefilled is whole blocks (uniform-state: positions), and whole pages: the prefill
        # never writes a shared page.
        unit = math.lcm(req.cursor.key_block, self.page_size)
        cached = len(pages) * self.page_size // unit * unit
        self._set_prefilled(req, cached)
        return pages[:cached // self.page_size]

    def _set_prefilled(self, req: Request, tokens: int) -> None:
        """A WAITING request's stored prompt K/V, its cost in the queue's sum updated."""
        self._waiting_tokens -= req.cursor.span_len
        req.cursor.prefilled = tokens
        self._waiting_tokens += req.cursor.span_len

    def _take_pages(self, req: Request, hit: list[int]) -> bool:
        """Its first admission: share the cached ``hit`` and allocate the rest of the
        canvas; False (nothing taken, nothing cached assumed) when the rest does not fit."""
        self.allocator.share(hit)  # before counting: a hit page nobody held counted as free
        n = req.cursor.num_pages(self.page_size) - len(hit)
        rings = self.rings
        if not (self.allocator.can_allocate(n)
                and (rings is None or rings.allocator.can_allocate(rings.shape.pages))):
            self.allocator.free(hit)
            if hit:  # the look-up's doing: nothing of the prompt is stored after all
                self._set_prefilled(req, 0)
            return False
        req.pages = hit + self.allocator.allocate(n)
        if rings is not None:
            req.window_pages = rings.allocator.allocate(rings.shape.pages)
        req.published = len(hit)
        if req.page_keys is not None:
            cache = self.prefix_cache
            cache.queries += req.cursor.prompt_len
            req.cached_tokens = req.cursor.prefilled
            cache.hits += req.cached_tokens
        return True

    def _hold(self, req: Request) -> None:
        self._requests[req.request_id] = req
        self.num_load_adaptive += req.load_adaptive

    def _release(self, req: Request) -> None:
        """Forget ``req`` and free its pages. Its heap entry, if any, goes stale."""
        rid = req.request_id
        del self._requests[rid]
        self.num_load_adaptive -= req.load_adaptive
        if self._waiting.pop(rid, None) is not None:
            self._waiting_tokens -= req.cursor.span_len
        self._seated.pop(rid, None)
        self._in_flight.pop(rid, None)
        if self._active is req:
            self._active = None
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        if req.window_pages:
            self.rings.allocator.free(req.window_pages)
            req.window_pages = []
