"""Request state machine, page allocator and BatchBuilder: every rule of docs/design.md §4.

The builder is driven as the engine and the simulator drive it: ``schedule`` then one
``step_done`` per scheduled request. Costs are in tokens: a refresh costs T = P + G; a cached
step costs B (dual), T - s (prefix) or T (none).
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sangam.sampling_params import CACHE_MODES
from sangam.sched.batch_builder import BatchBuilder, ScheduledBatch
from sangam.sched.block_cursor import BlockCursor
from sangam.sched.config import SchedulerConfig
from sangam.sched.page_allocator import OutOfPagesError, PageAllocator
from sangam.sched.request import CONTINUES, Request, RequestStatus, StepOutcome

W, PF, DE, FI = (RequestStatus.WAITING, RequestStatus.PREFILL, RequestStatus.DECODE,
                 RequestStatus.FINISHED)


def mk(rid: str, t: float = 0.0, P: int = 8, G: int = 16, B: int = 8,
       cache: str = "dual", priority: int = 0, **cadence) -> Request:
    return Request(rid, t, BlockCursor(P, G, B, cache=cache, **cadence), priority=priority)


def builder(num_pages: int = 1000, page_size: int = 4, **kw) -> BatchBuilder:
    return BatchBuilder(PageAllocator(num_pages), SchedulerConfig(page_size=page_size, **kw))


def ran(r: Request, block_done: bool, finished: bool) -> StepOutcome:
    """A forward of ``r`` as a runner reports it: its cursor moved (a chunk stored)."""
    if r.chunk_admitted:
        r.cursor.store_chunk()
        return CONTINUES
    r.cursor.advance(block_done, finished)
    return StepOutcome(block_done, finished)


def done(r: Request, now: float, block_done: bool, finished: bool) -> None:
    """``r``'s forward ran: the cursor moves, then the request records it."""
    r.mark_step_done(now, ran(r, block_done, finished))


def step(b: BatchBuilder, now: float, outcomes: dict | None = None) -> ScheduledBatch:
    """One iteration; every request keeps decoding unless ``outcomes[id] = (block_done,
    finished)`` says otherwise."""
    batch = b.schedule(now)
    for r in batch.prefills + batch.decodes:
        b.step_done(r, now, ran(r, *(outcomes or {}).get(r.request_id, (False, False))))
    return batch


def ids(reqs: list[Request]) -> list[str]:
    return [r.request_id for r in reqs]


def seat(b: BatchBuilder, *reqs: Request) -> None:
    """Admit and seat ``reqs``, then run one empty-queue iteration so the deficit is 0."""
    for r in reqs:
        b.add(r)
    while b.num_waiting:
        step(b, 0.0)
    step(b, 0.0)
    assert b.num_seated == len(reqs) and b.deficit == 0


# Request.
def test_request_geometry_and_spans():
    r = mk("a", P=10, G=24, B=8, cache="dual")
    c = r.cursor
    assert (c.total_len, c.num_blocks, c.span_len, c.decode_span) == (34, 3, 34, 8)
    p = mk("b", P=10, G=24, B=8, cache="prefix")
    assert p.cursor.decode_span == 34 - 10  # span [s, T) with s = P
    p.cursor.block = 2
    assert p.cursor.decode_span == 34 - (10 + 16)
    assert mk("c", P=10, G=24, B=8, cache="none").cursor.decode_span == 34
    assert (c.num_pages(16), c.num_pages(17), c.num_pages(1)) == (3, 2, 34)
    q = mk("d", t=0.0)
    assert r.queue_key < q.queue_key  # same arrival: creation order
    assert mk("h", t=5.0, priority=-1).queue_key < r.queue_key  # priority before arrival
    with pytest.raises(ValueError):
        mk("e", G=20, B=8)
    with pytest.raises(ValueError):
        mk("f", P=0)
    with pytest.raises(ValueError):
        mk("g", cache="paged")


def test_request_transitions_and_metrics():
    r = mk("a", t=1.0, G=16, B=8)  # two blocks
    with pytest.raises(ValueError):
        done(r, 1.0, False, False)  # not admitted
    r.mark_admitted(2.0)
    with pytest.raises(ValueError):
        r.mark_admitted(2.0)
    done(r, 3.0, False, False)
    assert r.status is DE
    done(r, 4.0, True, False)
    assert (r.status, r.cursor.block) == (W, 1)
    r.mark_admitted(6.0)
    done(r, 7.0, False, False)
    with pytest.raises(ValueError):  # the last block ended: the request must finish
        done(r, 8.0, True, False)
    done(r, 9.0, True, True)
    assert (r.status, r.finish_reason) == (FI, "length")
    with pytest.raises(ValueError):
        r.mark_aborted(10.0)
    m = r.metrics
    assert m.prefill_queued == [1.0, 4.0] and m.prefill_started == [2.0, 6.0]
    assert m.prefill_finished == [3.0, 7.0] and m.block_finished == [4.0, 9.0]
    assert m.num_steps == 4 and m.e2e_latency == 8.0 and m.time_to_first_block == 3.0
    assert m.queueing_time == (2.0 - 1.0) + (6.0 - 4.0)
    assert m.decode_time == (4.0 - 3.0) + (9.0 - 7.0)

    early = mk("b", G=16, B=8)
    early.mark_admitted(0.0)
    done(early, 1.0, True, True)  # EOS in the first block
    assert early.finish_reason == "stop" and early.metrics.decode_time == 0.0
    ab = mk("c")
    ab.mark_aborted(5.0)
    assert (ab.status, ab.finish_reason, ab.metrics.finish_time) == (FI, "abort", 5.0)


def test_refresh_cadence_transitions_and_costs():
    """Four blocks, refreshes every 2nd, every 2nd of those full: full, none, response, none."""
    r = mk("a", P=10, G=16, B=4, refresh_interval=2, prompt_refresh_interval=2)
    assert [r.cursor.block_refresh(b) for b in range(4)] == ["full", "none", "response", "none"]
    assert r.cursor.span_len == 26
    r.mark_admitted(1.0)
    done(r, 2.0, True, False)  # block 0 in its refresh
    assert (r.status, r.cursor.block) == (DE, 1)  # block 1 starts without one: stays seated
    done(r, 3.0, False, False)
    done(r, 4.0, True, False)
    assert (r.status, r.cursor.block, r.cursor.span_len) == (W, 2, 16)  # response-only: T - P
    r.mark_admitted(5.0)
    done(r, 6.0, True, False)
    assert (r.status, r.cursor.block) == (DE, 3)
    done(r, 8.0, True, True)
    m = r.metrics
    assert m.prefill_queued == [0.0, 4.0] and m.prefill_finished == [2.0, 6.0]
    assert m.decode_started == [2.0, 2.0, 6.0, 6.0] and m.block_finished == [2.0, 4.0, 6.0, 8.0]
    assert m.decode_time == 2.0 + 2.0 and m.queueing_time == 1.0 + 1.0

    # The builder keeps such a request seated across the boundary.
    b = builder(num_pages=16, page_size=4, policy="deficit", token_budget=64)
    q = mk("q", P=4, G=8, B=4, refresh_interval=2)
    b.add(q)
    (got,) = b.schedule(0.0).prefills
    b.step_done(got, 1.0, ran(got, block_done=True, finished=False))
    batch = b.schedule(1.0)
    assert batch.prefills == [] and batch.decodes == [q] and batch.decode_tokens == 4
    with pytest.raises(ValueError, match="refresh intervals"):
        mk("z", P=1, G=4, B=4, refresh_interval=0)

    # Its cache lost (taken back after a failure): the block refreshes fully, then the cadence
    # resumes.
    lost = mk("l", P=4, G=12, B=4, refresh_interval=2)
    lost.cursor.block, lost.cursor.force_refresh = 1, True
    assert (lost.cursor.block_refresh(1), lost.cursor.block_start, lost.cursor.span_len) == (
        "none", "full", 16)
    lost.mark_admitted(0.0)
    done(lost, 1.0, True, False)
    assert not lost.cursor.force_refresh and (lost.status, lost.cursor.block) == (W, 2)


def test_adaptive_budget_follows_the_prefill_queue():
    """tau = max(floor, waiting prefill tokens x waiting / (waiting + seated) / drain_iterations),
    recomputed every iteration: seated decodes pull it toward the floor."""
    b = builder(num_pages=1000, page_size=4, policy="adaptive", token_budget=64,
                drain_iterations=4)
    assert b.current_budget() == 64
    for i in range(10):
        b.add(mk(f"r{i}", float(i), P=88, G=8, B=8))
    assert b.waiting_tokens == 960 and b.current_budget() == 240
    batch = b.schedule(0.0)  # 240 tokens of budget: two refreshes of 96, 48 carried over
    assert len(batch.prefills) == 2 and batch.deficit == 48 and b.waiting_tokens == 8 * 96
    for r in batch.prefills:
        b.step_done(r, 1.0, ran(r, block_done=False, finished=False))
    assert b.num_seated == 2 and b.current_budget() == 154  # 768 * 8 / 10 = 614, / 4
    b.abort("r9")
    assert b.waiting_tokens == 7 * 96 and b.current_budget() == 131  # 672 * 7 // 9 = 522, / 4


# PageAllocator.
def test_page_allocator():
    a = PageAllocator(10)
    x = a.allocate(4)
    assert x == [0, 1, 2, 3] and (a.num_free, a.num_used, a.num_pages) == (6, 4, 10)
    assert a.can_allocate(6) and not a.can_allocate(7)
    with pytest.raises(OutOfPagesError):
        a.allocate(7)
    y = a.allocate(6)
    assert sorted(x + y) == list(range(10)) and a.num_free == 0
    a.free(x)
    with pytest.raises(ValueError):
        a.free(x)  # double free
    with pytest.raises(ValueError):
        a.free([10])  # foreign page
    with pytest.raises(ValueError):
        a.free([y[0], y[0]])
    assert a.num_used == 6  # failed frees changed nothing
    assert a.allocate(4) == x  # freed pages come back in the same order
    a.free(y)
    assert a.num_free == 6


# BatchBuilder: the deficit token budget.
def test_carry_over_admits_an_oversized_prefill_after_k_iterations():
    b = builder(token_budget=100)
    seat(b, mk("a"))  # one dual decode: span 8, so 100 - 8 = 92 fresh tokens per iteration
    b.add(mk("x", t=1.0, P=292, G=8, B=8))  # T = 300 > 92: needs ceil(300 / 92) = 4 iterations
    deficits = []
    for _ in range(3):
        batch = step(b, 1.0)
        assert batch.prefills == [] and batch.decode_tokens == 8
        deficits.append(batch.deficit)
    assert deficits == [92, 184, 276]
    batch = step(b, 1.0)  # remaining = 92 + 276 = 368 >= 300
    assert ids(batch.prefills) == ["x"] and not batch.idle_admission
    assert batch.deficit == 368 - 300


def test_head_of_line_blocks_smaller_prefills_behind_it():
    b = builder(token_budget=100)
    seat(b, mk("a"))
    b.add(mk("x", t=1.0, P=292, G=8, B=8))  # T = 300
    b.add(mk("y", t=2.0))  # T = 24 would fit 92 at once, but waits behind x
    for _ in range(3):
        assert step(b, 2.0).prefills == []
    batch = step(b, 2.0)  # 368: x (300), then y (24 <= 68)
    assert ids(batch.prefills) == ["x", "y"] and batch.deficit == 368 - 324


def test_deficit_never_negative_and_reset_when_nothing_waits():
    b = builder(token_budget=10)
    seat(b, mk("a", cache="none"))  # a "none" decode spans T = 24 > tau: budget 10 - 24 < 0
    b.add(mk("x", t=1.0))
    for _ in range(5):
        batch = step(b, 1.0)
        assert batch.prefills == [] and batch.deficit == 0 and batch.decode_tokens == 24
    b2 = builder(token_budget=100)
    seat(b2, mk("a"))
    b2.add(mk("x", t=1.0, P=292, G=8, B=8))
    assert step(b2, 1.0).deficit == 92
    b2.abort("x")
    assert step(b2, 1.0).deficit == 0  # the queue emptied: nothing is banked


def test_idle_rule_admits_one_prefill_over_budget():
    b = builder(token_budget=100)
    b.add(mk("x", P=292, G=8, B=8))  # T = 300 > tau, no decodes seated
    b.add(mk("y", t=1.0))
    batch = step(b, 0.0)
    assert ids(batch.prefills) == ["x"] and batch.idle_admission and batch.deficit == 0
    batch = step(b, 1.0)  # x is seated now: y goes by the budget (24 <= 100 - 8)
    assert ids(batch.decodes) == ["x"] and ids(batch.prefills) == ["y"]
    assert not batch.idle_admission and batch.deficit == 92 - 24
    within = builder(token_budget=100)
    within.add(mk("z"))  # T = 24 fits: an ordinary budget admission
    assert not step(within, 0.0).idle_admission


def test_memory_blocked_iterations_bank_no_budget():
    # 40 pages of 4 tokens; a (T = 24) holds 6, x (T = 150) needs 38: 34 free.
    b = builder(num_pages=40, page_size=4, token_budget=100)
    seat(b, mk("a", G=16, B=8))
    b.add(mk("x", t=1.0, P=142, G=8, B=8))
    batch = step(b, 1.0)  # 92 < 150: stopped by the budget, banks 92
    assert not batch.memory_blocked and batch.deficit == 92
    for _ in range(4):  # 184 >= 150 but the pages are missing: no banking
        batch = step(b, 1.0)
        assert batch.memory_blocked and batch.prefills == [] and batch.deficit == 92
    step(b, 2.0, {"a": (True, True)})  # a finishes and frees its pages
    batch = step(b, 3.0)  # no decodes: 100 + 92 = 192 >= 150
    assert ids(batch.prefills) == ["x"] and not batch.idle_admission
    assert batch.deficit == 192 - 150


def test_memory_blocked_charges_only_admissions_beyond_the_fresh_budget():
    b = builder(num_pages=40, page_size=4, token_budget=100)  # 40 pages = 160 tokens
    seat(b, mk("a"))  # 6 pages, decode span 8: fresh = 92
    b.add(mk("y", t=1.0, P=112, G=8, B=8))  # T = 120: 30 pages
    b.add(mk("z", t=2.0))  # 6 pages, 4 left after y: memory-blocked
    assert step(b, 1.0).deficit == 92
    batch = step(b, 1.0)  # remaining 184: y (120) admitted, then z memory-blocked
    assert ids(batch.prefills) == ["y"] and batch.memory_blocked
    assert batch.deficit == max(0, 92 - max(0, 120 - 92))  # = 64 (= 184 - 120 here)
    batch = step(b, 1.0)  # y seated now (decode 16): z still blocked, nothing banked
    assert batch.memory_blocked and batch.deficit == 64


def test_seated_decodes_are_never_displaced():
    b = builder(token_budget=1000)
    seats = [mk(f"d{i}") for i in range(5)]
    seat(b, *seats)
    b.token_budget = 16  # five dual decodes span 40 > 16
    b.add(mk("x", t=1.0))
    for _ in range(4):
        batch = step(b, 1.0)
        assert ids(batch.decodes) == ids(seats) and batch.prefills == []
    step(b, 2.0, {r.request_id: (True, True) for r in seats})
    batch = step(b, 3.0)  # nothing seated any more: the idle rule takes x
    assert ids(batch.prefills) == ["x"] and batch.idle_admission


def test_just_prefilled_request_decodes_from_the_next_iteration():
    b = builder()
    b.add(mk("a"))
    batch = step(b, 0.0)
    assert ids(batch.prefills) == ["a"] and batch.decodes == []
    batch = step(b, 1.0)
    assert batch.prefills == [] and ids(batch.decodes) == ["a"]


def test_max_batch_size_caps_seats_and_banks_nothing_while_full():
    b = builder(token_budget=1000, max_batch_size=2)
    for i in range(4):
        b.add(mk(f"r{i}", t=float(i)))
    batch = step(b, 0.0)
    assert ids(batch.prefills) == ["r0", "r1"]
    for _ in range(3):
        batch = step(b, 1.0)  # seats full: no admission, and the unused budget is not banked
        assert batch.prefills == [] and len(batch.decodes) == 2 and batch.deficit == 0
    step(b, 2.0, {"r0": (True, True)})
    batch = step(b, 3.0)
    assert ids(batch.prefills) == ["r2"] and len(batch.decodes) == 1


def test_prefill_first_admits_everything_that_fits_memory_head_of_line():
    b = builder(num_pages=3000, page_size=4, policy="prefill_first", token_budget=8)
    assert b.token_budget == math.inf
    for i in range(10):
        b.add(mk(f"q{i}", t=float(i), P=1000, G=32, B=32))  # 10 x 1032 tokens, one iteration
    batch = step(b, 0.0)
    assert len(batch.prefills) == 10 and batch.deficit == 0 and not batch.idle_admission
    small = builder(num_pages=20, page_size=4, policy="prefill_first")
    for i in range(4):
        small.add(mk(f"s{i}", t=float(i), P=4 if i == 3 else 8))  # 6, 6, 6, then 5 pages
    batch = step(small, 0.0)  # 2 pages left: s3 blocks, head-of-line
    assert ids(batch.prefills) == ["s0", "s1", "s2"] and batch.memory_blocked
    assert batch.prefill_tokens == 3 * 24


def test_fastdllm_runs_one_request_to_completion():
    b = builder(policy="fastdllm")
    a, c = mk("a", t=0.0), mk("c", t=2.0)
    b.add(a)
    b.add(c)
    assert ids(step(b, 0.0).prefills) == ["a"]
    b.add(mk("b", t=-1.0))  # older than a, but a runs to completion first
    batch = step(b, 1.0, {"a": (True, False)})  # a's first block ends
    assert ids(batch.decodes) == ["a"] and a.status is W and b.num_waiting == 3
    batch = step(b, 2.0)  # a's re-prefill runs at once
    assert ids(batch.prefills) == ["a"] and batch.decodes == []
    step(b, 3.0, {"a": (True, True)})
    order = []
    while b.has_work:
        batch = step(b, 4.0, {r.request_id: (True, True) for r in batch.decodes})
        assert len(batch.prefills) + len(batch.decodes) <= 1 and batch.deficit == 0
        order += ids(batch.prefills)
    assert order == ["b", "c"] and b.allocator.num_free == b.allocator.num_pages


def test_abort_frees_pages_wherever_the_request_is():
    b = builder(num_pages=100, page_size=4, token_budget=1000)
    b.add(mk("seated"))
    b.add(mk("reprefill"))
    step(b, 0.0)
    step(b, 1.0, {"reprefill": (True, False)})  # back in the queue, holding its pages
    b.add(mk("queued", t=5.0, P=344))  # 90 pages, 88 free: memory-blocked
    b.add(mk("inflight", t=6.0))
    batch = b.schedule(2.0)
    assert ids(batch.prefills) == ["reprefill"] and batch.memory_blocked
    assert b.allocator.num_used == 12
    for rid in ["queued", "reprefill", "seated"]:  # reprefill is in flight right now
        r = b.abort(rid)
        assert r is not None and (r.status, r.finish_reason, r.pages) == (FI, "abort", [])
    assert b.abort("seated") is None and b.abort("nobody") is None
    assert b.allocator.num_free == 100
    b.step_done(batch.prefills[0], 3.0, CONTINUES)  # a late result of an aborted request
    assert b.num_seated == 0  # is dropped
    batch = step(b, 3.0)
    assert ids(batch.prefills) == ["inflight"]
    b.abort("inflight", now=4.0)
    assert not b.has_work and b.allocator.num_free == 100 and step(b, 5.0).is_empty


def test_reprefill_keeps_its_original_priority():
    b = builder(token_budget=100)
    a = mk("a", t=0.0)
    b.add(a)
    step(b, 0.0)
    b.add(mk("x", t=1.0, P=292, G=8, B=8))  # a later, oversized arrival waits for budget
    step(b, 1.0, {"a": (True, False)})  # a's block 0 ends: a is queued again...
    assert a.queue_key == (0, 0.0, a.seq) and b.num_waiting == 2
    batch = step(b, 2.0)  # ... ahead of x: no decodes, the idle rule takes the head, a
    assert ids(batch.prefills) == ["a"] and a.cursor.block == 1


def test_priority_orders_admission_before_arrival():
    """vLLM's priority: a lower value is admitted first, whatever its arrival; equal values go
    by arrival. Head-of-line still holds, now in that order."""
    b = builder(token_budget=40)
    seat(b, mk("busy", P=8, G=16))  # 8 decode tokens a step: 32 left for prefills
    b.add(mk("old", t=1.0, P=16))  # cost 32
    b.add(mk("urgent", t=2.0, P=16, priority=-1))
    b.add(mk("later", t=3.0, P=8, priority=-1))  # cost 24: does not fit beside urgent
    admitted = [ids(step(b, 4.0 + i).prefills) for i in range(8)]
    assert [a for a in admitted if a] == [["urgent"], ["later"], ["old"]]


def test_out_of_order_arrival_cannot_deadlock_memory():
    # 12 pages of 4: a and b (6 pages each) fill the pool; c arrives with an older timestamp.
    b = builder(num_pages=12, page_size=4, token_budget=1000)
    b.add(mk("a", t=5.0))
    b.add(mk("b", t=6.0))
    step(b, 5.0)
    b.add(mk("c", t=0.0))
    step(b, 6.0, {"a": (True, False), "b": (True, False)})  # both queue again behind c
    batch = step(b, 7.0)  # c is memory-blocked; a, which holds pages, runs instead
    assert ids(batch.prefills) == ["a"] and batch.memory_blocked and batch.idle_admission
    step(b, 8.0, {"a": (True, True)})  # a finishes: its pages let c in
    batch = step(b, 9.0)
    assert ids(batch.prefills) == ["c", "b"]  # b holds its pages: no allocation


def test_driver_misuse_raises():
    b = builder(num_pages=10, page_size=4)
    with pytest.raises(ValueError, match="can never fit"):
        b.add(mk("huge", P=100))
    assert not b.fits_ever(mk("huge", P=100)) and b.fits_ever(mk("ok"))
    r = mk("r")
    b.add(r)
    with pytest.raises(ValueError):
        b.add(mk("r"))  # duplicate id
    b.schedule(0.0)
    with pytest.raises(RuntimeError):
        b.schedule(1.0)  # step_done missing
    with pytest.raises(ValueError):
        b.step_done(mk("stranger"), 1.0, CONTINUES)
    b.step_done(r, 1.0, ran(r, False, False))
    with pytest.raises(ValueError):
        b.step_done(r, 1.0, CONTINUES)  # reported twice
    with pytest.raises(ValueError):
        builder(policy="sjf")
    with pytest.raises(ValueError):
        builder(token_budget=0)


# Properties over random runs.
REQ = st.tuples(
    st.integers(0, 30),  # iteration at which it is added
    st.integers(0, 8),  # arrival_time = that iteration - lag: adds are not in arrival order
    st.integers(1, 120),  # prompt length
    st.integers(1, 4),  # blocks
    st.sampled_from([4, 8, 16]),  # block length
    st.sampled_from(CACHE_MODES),
    st.sampled_from([0, 0, 0, 1, -1]),  # priority
)


# Spare pages beyond the largest request: often none, so that memory blocks admission.
EXTRA_PAGES = st.one_of(st.integers(0, 4), st.integers(0, 80))


def simulate(b: BatchBuilder, specs: list, seed: int, abort_prob: float = 0.0,
             check=None) -> list[Request]:
    """Drive ``b`` over random arrivals and block outcomes until every request is done."""
    rng = random.Random(seed)
    arrivals: dict[int, list] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault(spec[0], []).append((i, spec))
    reqs: list[Request] = []
    it = 0
    while it <= max(arrivals) or b.has_work:
        for i, (t, lag, P, nb, B, cache, priority) in arrivals.get(it, []):
            r = mk(f"r{i}", float(t - lag), P, nb * B, B, cache, priority=priority)
            reqs.append(r)
            b.add(r)
        if abort_prob and reqs and rng.random() < abort_prob:
            b.abort(rng.choice(reqs).request_id)  # anywhere: queued, seated, or gone
        before = (b.deficit, [r for r in reqs if r.status is W], [r for r in reqs
                                                                  if r.status is DE])
        batch = b.schedule(float(it))
        if check:
            check(batch, *before)
        for r in batch.prefills + batch.decodes:
            if abort_prob and rng.random() < abort_prob:  # aborted while in flight
                b.abort(r.request_id)
                continue
            block_done = rng.random() < 0.4
            finished = block_done and (r.cursor.block + 1 == r.cursor.num_blocks
                                       or rng.random() < 0.2)
            b.step_done(r, float(it), ran(r, block_done, finished))
        held = [r for r in reqs if r.status is not FI]
        assert all(len(r.pages) == r.cursor.num_pages(b.page_size) for r in held if r.pages)
        assert b.allocator.num_used == sum(len(r.pages) for r in held)  # no page leaks
        it += 1
        assert it < 5000, "the builder stopped making progress"
    assert all(r.status is FI and not r.pages for r in reqs)
    assert b.allocator.num_free == b.allocator.num_pages
    return reqs


def pool_for(specs: list, page_size: int, extra: int) -> int:
    return max(-(-(p + nb * bl) // page_size) for _, _, p, nb, bl, *_ in specs) + extra


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(REQ, min_size=1, max_size=25), tau=st.integers(1, 400),
       page_size=st.sampled_from([1, 4, 16]), extra=EXTRA_PAGES,
       max_batch=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_property_deficit_budget_is_never_exceeded(specs, tau, page_size, extra, max_batch,
                                                   seed):
    """With a_i the prefill tokens admitted by the budget in iteration i (0 in an iteration
    whose admission was by the idle rule), d_i its decode tokens and D_i the deficit after it
    (D_0 = 0), every iteration satisfies

        a_i <= max(0, tau - d_i) + D_{i-1} - D_i,        D_i >= 0,

    hence for every n:  sum_{i<=n} a_i + D_n <= sum_{i<=n} max(0, tau - d_i)
    (= tau * n - sum d_i when decodes never exceed tau: a prefill cannot be split, so the budget
    holds amortized, and decode tokens above tau are not charged to later prefills)."""
    b = builder(pool_for(specs, page_size, extra), page_size, token_budget=tau,
                max_batch_size=max_batch)
    totals = {"a": 0, "fresh": 0}

    def check(batch: ScheduledBatch, deficit_before: int, waiting: list, seated: list) -> None:
        d_i, D_i = batch.decode_tokens, batch.deficit
        assert D_i >= 0 and D_i == b.deficit
        assert sorted(ids(batch.decodes)) == sorted(ids(seated))  # all seated run, none displaced
        assert not set(ids(batch.prefills)) & set(ids(batch.decodes))
        assert all(r.status is PF for r in batch.prefills)
        assert len(batch.prefills) + len(batch.decodes) <= max_batch
        assert d_i == sum(r.cursor.decode_span for r in seated)
        assert batch.prefill_tokens == sum(r.cursor.span_len for r in batch.prefills)
        if not waiting:
            assert D_i == 0 and batch.prefills == []
        if batch.idle_admission:
            assert batch.decodes == [] and len(batch.prefills) == 1
        else:  # strict head-of-line: exactly the k first waiting requests in queue order
            in_order = sorted(waiting, key=lambda r: r.queue_key)
            assert ids(batch.prefills) == ids(in_order[:len(batch.prefills)])
        if batch.memory_blocked:
            assert D_i <= deficit_before  # blocked iterations bank nothing
        a_i = 0 if batch.idle_admission else batch.prefill_tokens
        assert a_i <= max(0, tau - d_i) + deficit_before - D_i
        totals["a"] += a_i
        totals["fresh"] += max(0, tau - d_i)
        assert totals["a"] + D_i <= totals["fresh"]

    simulate(b, specs, seed, check=check)


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(REQ, min_size=1, max_size=25),
       policy=st.sampled_from(["deficit", "prefill_first", "fastdllm", "adaptive"]),
       tau=st.integers(1, 400), page_size=st.sampled_from([1, 4, 16]),
       extra=EXTRA_PAGES, max_batch=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       abort_prob=st.sampled_from([0.0, 0.05, 0.3]))
def test_property_no_page_leak_with_random_aborts(specs, policy, tau, page_size, extra,
                                                  max_batch, seed, abort_prob):
    b = builder(pool_for(specs, page_size, extra), page_size, policy=policy, token_budget=tau,
                max_batch_size=max_batch)

    def check(batch: ScheduledBatch, deficit_before: int, waiting: list, seated: list) -> None:
        assert sorted(ids(batch.decodes)) == sorted(ids(seated)) and batch.deficit >= 0
        # The adaptive budget's input, kept incrementally, is the queue's exact sum.
        assert b.waiting_tokens == sum(r.cursor.span_len for r in waiting if r.status is W)
        if policy == "fastdllm":
            assert len(batch.prefills) + len(batch.decodes) <= 1 and batch.deficit == 0

    reqs = simulate(b, specs, seed, abort_prob, check)
    if not abort_prob:
        assert all(r.finish_reason in ("stop", "length") for r in reqs)
