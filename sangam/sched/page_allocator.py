"""KV page allocator: which of a pool's ``num_pages`` pages are in use (docs/design.md §4).

Pure bookkeeping, no tensors: page ``i`` names slots ``[i * page_size, (i + 1) * page_size)``
of the KV pool, which lives elsewhere. Every operation is O(pages moved).
"""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """``allocate`` asked for more pages than are free."""


class PageAllocator:
    """Free list of page ids.

    Invariants: ``_free`` and the pages marked in ``_used`` partition ``range(num_pages)``;
    ``free`` accepts only pages currently allocated, each once (a double free or a foreign page
    raises and changes nothing).
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self._num_pages = num_pages
        # A stack, top at the end; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"cannot allocate {n} pages: {len(self._free)} of "
                              f"{self._num_pages} free")
        cut = len(self._free) - n
        pages = self._free[cut:]
        del self._free[cut:]
        pages.reverse()
        used = self._used
        for p in pages:
            used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        used = self._used
        for p in pages:
            if not (isinstance(p, int) and 0 <= p < self._num_pages):
                raise ValueError(f"page {p!r} does not belong to this pool")
            if not used[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
        if len(set(pages)) != len(pages):
            raise ValueError("the same page appears twice in one free()")
        for p in pages:
            used[p] = 0
        # Reversed, so that the next allocation of the same size returns the same order.
        self._free.extend(reversed(pages))
