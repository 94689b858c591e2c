"""The sliding-window half of a hybrid KV pool: each request's ring of pages (docs/design.md
§4.2.2).

A sliding-window layer's query at position p reads keys (p - window, p] (a canvas row, from its
canvas's start - window + 1), so a request needs only its last positions in those layers, not
all of them. Under the hybrid pool the full layers keep their pages as every model does (one
per ``page_size`` positions of the whole request) and the sliding layers get, per request, a
fixed *ring* of ``ring`` pages of their own pool: position p lives in ring page
``(p // page_size) % ring`` at offset ``p % page_size``, so the ring holds the last
``ring * page_size`` positions written. One forward of a request covers positions [a, e) and
reads back to a - window + 1; those ``e - a + window - 1`` positions must not share a slot,
which holds when ``e - a <= max_span`` and ``ring * page_size >= max_span + window - 1``. The
scheduler keeps every forward within ``max_span``: a prompt is stored in chunks of whole
blocks within the token budget, and a later canvas's first step spans two canvases.

A position outside a query's bounds may share its slot with another position, or with none
written yet: the attention masks it (weight 0), and the pool starts zeroed, so what it reads
there is finite. Pure bookkeeping: the pages are the engine's (``KVPool``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sangam.sched.page_allocator import PageAllocator

KV_POOLS = ("auto", "single", "hybrid")  # --kv-pool


def kv_pool_problem(kv_pool: str, mode: str, enable_prefix_caching: bool | None) -> str | None:
    """What is wrong with ``--kv-pool`` among these flags (the engine's and the simulator's
    rule), or None: a hybrid pool shares no prefix and moves no K/V between workers."""
    if kv_pool not in KV_POOLS:
        return f"kv_pool must be one of {KV_POOLS}, got {kv_pool!r}"
    if kv_pool == "hybrid" and enable_prefix_caching:
        return ("--kv-pool hybrid and --enable-prefix-caching exclude each other: a ring keeps "
                "no sliding-window pages a later prompt could share")
    if kv_pool == "hybrid" and mode != "colocated":
        return (f"--kv-pool hybrid serves colocated workers only: {mode} mode moves K/V "
                "between workers page by page, and a ring's pages are not positions")
    return None


# The most prompt positions one forward of a request stores under a hybrid pool when the token
# budget is infinite (prefill-first); otherwise the budget bounds it.
PREFILL_CHUNK = 1024


@dataclass(frozen=True)
class RingShape:
    """A hybrid pool's ring: ``pages`` a request, and the most positions one forward of it may
    cover (``max_span``: a prompt chunk of whole blocks within the token budget, or a later
    block's first step, the finished block and the new one)."""

    pages: int
    max_span: int

    @classmethod
    def of(cls, window: int, page_size: int, block_length: int,
           token_budget: float) -> RingShape:
        chunk = PREFILL_CHUNK if math.isinf(token_budget) else int(token_budget)
        max_span = max(chunk // block_length, 2) * block_length
        return cls(-(-(max_span + window - 1) // page_size), max_span)


def ring_for(kv_pool: str, model: str, window: int, block_length: int, page_size: int,
             token_budget: float, colocated: bool, prefix_caching: bool) -> RingShape | None:
    """Each request's ring under ``kv_pool`` (the engine's and the simulator's decision), None
    for one pool of every layer: ``hybrid`` asks for it (``model`` without sliding-window
    layers, ``window`` 0, is refused), ``auto`` takes it where it serves: sliding layers,
    colocated workers, prefix caching off."""
    if kv_pool == "hybrid" and not window:
        raise ValueError(f"--kv-pool hybrid: {model} has no sliding-window layers (only "
                         "DiffusionGemma's keep a window)")
    if not window or kv_pool == "single" or (
            kv_pool == "auto" and (prefix_caching or not colocated)):
        return None
    return RingShape.of(window, page_size, block_length, token_budget)


@dataclass
class WindowRings:
    """The sliding layers' pages: their allocator, and the rings' shape."""

    allocator: PageAllocator
    shape: RingShape
