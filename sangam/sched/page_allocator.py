"""KV page allocator: which of a pool's ``num_pages`` pages are in use (docs/design.md §4).

Pure bookkeeping, no tensors: page ``i`` names slots ``[i * page_size, (i + 1) * page_size)``
of the KV pool, which lives elsewhere. Every operation is O(pages moved).

A page is free, in use by one or more holders (reference-counted: a prefix cache's page is
shared by every request whose prompt starts with it), or cached and unreferenced: counted free,
and reclaimed least recently released first when the free list runs out
(``sangam/sched/prefix_cache.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class OutOfPagesError(RuntimeError):
    """``allocate`` asked for more pages than are free."""


class PageCache(Protocol):
    """What the allocator asks of a prefix cache over its pages."""

    def keeps(self, page: int) -> bool:
        """Whether ``page``, just unreferenced, stays cached (reusable until reclaimed)."""

    def forget(self, page: int) -> None:
        """``page`` is reclaimed (or was never final): drop it from the cache."""


class PageAllocator:
    """Free list of page ids, reference counts, and the cached pages nobody holds.

    Invariants: ``_free``, the pages in ``_cached_free`` and the pages with ``_refs > 0``
    partition ``range(num_pages)``; ``free`` accepts only pages currently held, once per
    reference (a double free or a foreign page raises and changes nothing); a page in
    ``_cached_free`` is one the cache keeps.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self._num_pages = num_pages
        # A stack, top at the end; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.cache: PageCache | None = None  # set by the prefix cache over this pool

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free, or cached and unreferenced."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self._num_pages - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPagesError(f"cannot allocate {n} pages: {self.num_free} of "
                                  f"{self._num_pages} free")
        while len(self._free) < n:  # reclaim the cached pages released longest ago
            page, _ = self._cached_free.popitem(last=False)
            self.cache.forget(page)
            self._free.append(page)
        cut = len(self._free) - n
        pages = self._free[cut:]
        del self._free[cut:]
        pages.reverse()
        refs = self._refs
        for p in pages:
            refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Take another reference to each of ``pages``: held ones, or cached ones nobody holds
        (a prefix cache hit)."""
        refs = self._refs
        for p in pages:
            if not (refs[p] or p in self._cached_free):
                raise ValueError(f"page {p} is neither held nor cached")
        for p in pages:
            if not refs[p]:
                del self._cached_free[p]
            refs[p] += 1

    def drop_cached(self) -> None:
        """Every cached page nobody holds becomes free (its cache forgets it)."""
        for p in self._cached_free:
            self.cache.forget(p)
        self._free.extend(reversed(self._cached_free))
        self._cached_free.clear()

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``; a page nobody holds any more is free, or
        stays cached when the cache keeps it."""
        refs = self._refs
        for p in pages:
            if not (isinstance(p, int) and 0 <= p < self._num_pages):
                raise ValueError(f"page {p!r} does not belong to this pool")
            if not refs[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise ValueError("the same page appears twice in one free()")
        released = []
        for p in pages:
            refs[p] -= 1
            if refs[p]:
                continue
            if self.cache is not None and self.cache.keeps(p):
                self._cached_free[p] = None
            else:
                if self.cache is not None:
                    self.cache.forget(p)
                released.append(p)
        # Reversed, so that the next allocation of the same size returns the same order.
        self._free.extend(reversed(released))
