"""Router placement (docs/design.md §4, Modes): by load, seeded ties, hybrid overflow, liveness."""

from __future__ import annotations

import pytest

from sangam.sched.block_cursor import BlockCursor
from sangam.sched.placement import Placed
from sangam.sched.router import Router

ROOMY = [10_000] * 4  # free pages per worker: room everywhere


def mk(rid: str = "r", P: int = 8, G: int = 16, holder: int | None = None,
       pages: int | None = None) -> Placed:
    """T = P + G tokens: ceil(T / 16) pages at the default page size, or ``pages``.
    ``holder``: the worker that already holds its canvas (a re-prefill)."""
    need = -(-(P + G) // 16) if pages is None else pages
    r = Placed(rid, 0.0, BlockCursor(P, G, 8), pages_needed=need, attempt=0)
    r.holder = holder
    return r


def test_colocated_places_by_load_and_accounts():
    rt = Router("colocated", ["colocated"] * 3, seed=0)
    rt.add(0, 500)
    rt.add(1, 100)
    rt.add(2, 300)
    w = rt.route_prefill(mk(P=40), ROOMY[:3])  # T = 56
    assert w == 1 and rt.load(1) == 156  # routing records the prefill's cost
    rt.add(1, 200)
    assert rt.route_prefill(mk(), ROOMY[:3]) == 2
    rt.done(1, 356)
    assert rt.load(1) == 0 and rt.route_prefill(mk(), ROOMY[:3]) == 1
    with pytest.raises(ValueError):
        rt.done(1, 10_000)  # more than outstanding


def test_colocated_reprefill_stays_on_its_pages():
    rt = Router("colocated", ["colocated"] * 2)
    rt.add(1, 10_000)
    assert rt.route_prefill(mk(holder=1), ROOMY[:2]) == 1  # the most loaded, but it holds pages
    assert rt.load(1) == 10_024


def test_colocated_prefers_workers_with_room():
    rt = Router("colocated", ["colocated"] * 3)
    rt.add(1, 50)
    rt.add(2, 90)
    r = mk(P=24, G=16)  # 40 tokens: 3 pages of 16
    assert rt.route_prefill(r, [2, 3, 9]) == 1  # worker 0 is idle but has 2 free pages
    assert rt.route_prefill(r, [0, 0, 0]) == 0  # nobody has room: the least loaded waits


def test_seeded_tie_break_is_reproducible_and_random():
    def picks(seed: int) -> list[int]:
        rt = Router("colocated", ["colocated"] * 4, seed=seed)
        out = []
        for _ in range(40):
            out.append(rt.route_prefill(mk(), ROOMY))
            rt.done(out[-1], 24)  # loads stay equal: every pick is a four-way tie
        return out

    assert picks(7) == picks(7)
    assert picks(7) != picks(8)
    assert set(picks(7)) == {0, 1, 2, 3}


def test_disaggregated_uses_prefill_workers_only():
    rt = Router("disaggregated", ["prefill", "decode", "prefill", "decode"])
    rt.add(0, 5000)
    rt.add(2, 4000)
    assert rt.route_prefill(mk(), ROOMY) == 2  # decode workers are idle, but never prefill
    assert rt.route_prefill(mk(holder=1), ROOMY) == 2  # a re-prefill too; K/V goes back to 1


def test_hybrid_overflows_only_when_every_prefill_worker_is_at_theta():
    rt = Router("hybrid", ["prefill", "prefill", "decode", "decode"], overflow_threshold=100)
    rt.add(0, 150)
    rt.add(1, 99)
    rt.add(3, 10)
    assert rt.route_prefill(mk(P=1, G=8), ROOMY) == 1  # worker 1 below theta: 99 -> 108
    assert rt.load(1) == 108
    # Now both prefill workers are >= 100: overflow to the least-loaded decode worker.
    assert rt.route_prefill(mk(), ROOMY) == 2  # 2 (0) < 3 (10)
    assert rt.route_prefill(mk(), [9, 9, 0, 9]) == 3  # 2 has no room: 3
    rt.add(3, 200)
    assert rt.load(2) == 24 and rt.route_prefill(mk(), [9, 9, 0, 9]) == 1  # no decode qualifies
    rt.add(2, 100)  # both decode workers >= theta now
    assert rt.route_prefill(mk(), ROOMY) == 1  # 132 < 150


def test_hybrid_holder_overflows_only_to_its_own_decode_worker():
    rt = Router("hybrid", ["prefill", "decode", "decode"], overflow_threshold=50)
    rt.add(0, 60)
    rt.add(2, 10)
    assert rt.route_prefill(mk(holder=1), [0, 0, 0]) == 1  # no room needed where the pages are
    rt.add(1, 100)  # its decode worker is over theta now: the prefill worker, not worker 2
    assert rt.route_prefill(mk(holder=1), ROOMY[:3]) == 0


def test_dead_workers_are_never_chosen():
    rt = Router("colocated", ["colocated"] * 3)
    rt.add(1, 10)
    rt.add(2, 20)
    rt.mark_dead(0)
    assert not rt.is_alive(0)
    assert rt.route_prefill(mk(), ROOMY[:3]) == 1
    with pytest.raises(RuntimeError):
        rt.route_prefill(mk(holder=0), ROOMY[:3])  # its pages died with worker 0
    assert rt.route_decode(mk(pages=4), [100, 5, 6]) == 2
    hyb = Router("hybrid", ["prefill", "decode"], overflow_threshold=10)
    hyb.mark_dead(0)  # no live prefill worker: decode worker 1 takes it
    assert hyb.route_prefill(mk(), ROOMY[:2]) == 1
    for w in range(3):
        rt.mark_dead(w)
    with pytest.raises(RuntimeError, match="no worker is alive"):
        rt.route_prefill(mk(), ROOMY[:3])
    rt.revive(1)  # a new process in its place (a node that came back): no load, chosen
    assert rt.is_alive(1) and rt.load(1) == 0
    assert rt.route_prefill(mk(), ROOMY[:3]) == 1


@pytest.mark.parametrize("mode", ["disaggregated", "hybrid"])
def test_workers_of_one_role_serve_as_colocated_ones(mode):
    """Failover: with every prefill worker dead the decode workers run refreshes, with every
    decode worker dead the prefill workers hold canvases; a request's block runs where its
    canvas is."""
    roles = ["prefill", "prefill", "decode", "decode"]
    no_prefill = Router(mode, roles, overflow_threshold=10)
    assert not no_prefill.one_role_left
    no_prefill.mark_dead(0)
    assert no_prefill.route_prefill(mk(), ROOMY[:4]) == 1  # one prefill worker left: as ever
    no_prefill.mark_dead(1)
    assert no_prefill.one_role_left
    assert no_prefill.prefill_capable() == no_prefill.canvas_capable() == [2, 3]
    assert no_prefill.route_prefill(mk(holder=3), ROOMY[:4]) == 3  # where its canvas is
    assert no_prefill.route_prefill(mk(), [0, 0, 50, 5]) == 2  # a new one: where it fits
    assert no_prefill.route_decode(mk(pages=8), [0, 0, 5, 50]) == 3
    no_decode = Router(mode, roles, overflow_threshold=10)
    no_decode.mark_dead(2)
    no_decode.mark_dead(3)
    assert no_decode.one_role_left and no_decode.canvas_capable() == [0, 1]
    assert no_decode.route_decode(mk(pages=8), [5, 50, 0, 0]) == 1  # a prefill worker holds it
    assert no_decode.route_prefill(mk(holder=0), ROOMY[:4]) == 0  # and runs its blocks


def test_decode_placement_by_free_pages():
    rt = Router("disaggregated", ["prefill", "decode", "decode", "decode"], seed=3)
    assert rt.route_decode(mk(pages=5), [999, 10, 30, 20]) == 2  # the prefill worker never holds
    assert rt.route_decode(mk(pages=5), [999, 10, 3, 20]) == 3
    assert rt.route_decode(mk(pages=5), [999, 4, 3, 4]) is None  # nobody fits now
    assert rt.route_decode(mk(holder=1, pages=5), [999, 0, 30, 20]) == 1  # never migrated
    ties = {rt.route_decode(mk(pages=5), [0, 8, 8, 8]) for _ in range(30)}
    assert ties == {1, 2, 3}
    col = Router("colocated", ["colocated"] * 2)
    assert col.route_decode(mk(pages=5), [7, 9]) == 1


def test_invalid_configurations_raise():
    for args in [("mesh", ["colocated"]), ("colocated", []), ("colocated", ["prefill"]),
                 ("disaggregated", ["prefill", "prefill"]), ("hybrid", ["prefill", "decode"])]:
        with pytest.raises(ValueError):
            Router(*args)
    rt = Router("colocated", ["colocated"] * 2)
    with pytest.raises(ValueError):
        rt.route_prefill(mk(), [1, 2, 3])  # one free-page count per worker


def test_a_rejoined_worker_takes_new_requests_and_its_new_pool():
    from sangam.sched.config import DeploymentConfig, SchedulerConfig
    from sangam.sched.placement import Placement

    pl = Placement(DeploymentConfig(SchedulerConfig(page_size=4), "colocated", 2), [10, 10])
    with pytest.raises(ValueError, match="not dead"):
        pl.worker_rejoined(1, 12)
    pl.add("a", 0.0, BlockCursor(8, 8, 8))
    pl.place()
    holder = pl.requests["a"].worker
    taken = pl.worker_dead(holder)
    assert [p.request_id for p, _ in taken] == ["a"] and pl.free_pages()[holder] == 0
    pl.worker_rejoined(holder, 12)
    assert pl.dead == [] and pl.free_pages()[holder] == 12
