"""Prefix caching for block-causal and uniform-state models (docs/design.md §4, Prefix caching).

A block-causal model's K/V of a finished block never changes: nothing after a block is visible
to it. So the pages of a prompt's whole blocks can serve every later request whose prompt starts
with the same tokens, and that request's prefill starts at the first block not cached
(``BlockCursor.prefilled``). A uniform-state model's (DiffusionGemma's) causal encoder is the
same at the grain of one position: its K/V of a prompt or a finished canvas depends on the
tokens up to there only, so every whole page of them is cacheable. A bidirectional model has no
such pages: every prompt position attends to the response, so nothing is cached for it.

Keys: page ``i`` of a request is keyed by a digest chained over the pages before it and its own
tokens, extended to the end of the block that holds its last position (a page that ends inside
a block depends on the rest of that block), under a root naming the page size and the block
length (the block-causal mask's). The digest is cryptographic (BLAKE2b, 128 bits), so no prompt
can be made to collide with another's prefix.

A request's finished response blocks join its keys as they end (their final K/V is stored by
the next block's first step), so a conversation's next turn finds its earlier turns cached.

A page is published when the forward that computes its final K/V is scheduled (*pending*), and
is *ready* once that forward ran: a request whose prefix reaches a pending page waits for the
next iteration rather than compute it again, so ``n`` samples of one prompt, or identical prompts
arriving together, compute it once. A ready page nobody holds stays cached until the allocator
reclaims it (least recently released first); a pending page whose owner fails or is aborted is
dropped. Pure Python, owned by one worker's batch builder.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from sangam.sched.block_cursor import BlockCursor
from sangam.sched.page_allocator import PageAllocator

_DIGEST_BYTES = 16


def caches_prefixes(exact: bool, enabled: bool | None, kv_pool: str = "auto") -> bool:
    """Whether workers cache prompt pages (the engine's rule, and the simulator's): as
    ``--enable-prefix-caching`` says, else for a model whose finished K/V is ``exact``
    (block-causal, or uniform-state); never in a hybrid pool (``--kv-pool hybrid``: its rings
    keep no prefix, ``window_rings.py``)."""
    if kv_pool == "hybrid":
        return False
    return exact if enabled is None else enabled


def prefix_page_keys(tokens: Sequence[int], cached_len: int, page_size: int,
                     block_length: int) -> list[bytes]:
    """The keys of the pages wholly inside ``tokens[:cached_len]`` (``cached_len``: a multiple
    of ``block_length``, so every key's tokens are there), in order."""
    keys: list[bytes] = []
    extend_page_keys(keys, tokens, cached_len, page_size, block_length)
    return keys


def request_page_keys(cursor: BlockCursor, tokens: Sequence[int], page_size: int
                      ) -> list[bytes] | None:
    """The keys a worker gives a request it takes (the engine's and the simulator's alike): a
    block-causal or uniform-state request yet to store any of its prompt gets its prompt's
    pages'; None for any other (nothing to look up)."""
    if not cursor.exact or cursor.block or cursor.prefilled:
        return None
    return prefix_page_keys(tokens, cursor.block_origin, page_size, cursor.key_block)


def extend_page_keys(keys: list[bytes], tokens: Sequence[int], cached_len: int,
                     page_size: int, block_length: int) -> None:
    """Append to ``keys`` (those of the first pages) the keys of the pages up to
    ``tokens[:cached_len]``, as :func:`prefix_page_keys` (a request's finished blocks join its
    prompt's as they become final)."""
    if cached_len % block_length:
        raise ValueError(f"cached_len ({cached_len}) must be a multiple of block_length "
                         f"({block_length})")
    # Token ids as int64 bytes (a numpy array of them, a list: the same digest). Pure Python:
    # the policy core imports neither torch nor numpy.
    arr = array("q", tokens[:cached_len])
    key = keys[-1] if keys else hashlib.blake2b(
        f"sangam-prefix/{page_size}/{block_length}".encode(), digest_size=_DIGEST_BYTES).digest()
    for i in range(len(keys), cached_len // page_size):
        end = (i + 1) * page_size
        depends_to = -(-end // block_length) * block_length
        h = hashlib.blake2b(key, digest_size=_DIGEST_BYTES)
        h.update(arr[i * page_size:depends_to])
        key = h.digest()
        keys.append(key)


class PrefixCache:
    """The cached pages of one pool, by key. Invariants: ``_page_of`` and ``_key_of`` are
    inverse maps; ``_pending`` is a subset of the cached pages; a page nobody holds is cached
    only when ready (the allocator asks ``keeps``)."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        allocator.cache = self
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._pending: set[int] = set()
        # vLLM's counters, in tokens: prompt tokens looked up, and those found cached.
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._key_of)

    def match(self, keys: Sequence[bytes]) -> tuple[list[int], bool]:
        """The ready pages of the longest cached prefix of ``keys``, and whether the page after
        them is pending (its forward is in this iteration: wait for it)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                return pages, False
            if page in self._pending:
                return pages, True
            pages.append(page)
        return pages, False

    def publish(self, keys: Sequence[bytes], pages: Sequence[int]) -> list[int]:
        """Pages whose final K/V the admitted forward computes, pending until ``ready``; a key
        already cached (another page holds it) is left to that page. Returns those
        published."""
        published = []
        for key, page in zip(keys, pages):
            if key in self._page_of or page in self._key_of:
                continue
            self._page_of[key] = page
            self._key_of[page] = key
            self._pending.add(page)
            published.append(page)
        return published

    def ready(self, pages: Sequence[int]) -> None:
        """Their forward ran: their K/V is final."""
        self._pending.difference_update(pages)

    def clear(self) -> None:
        """Forget every cached page (the weights changed, or the pool's contents were
        dropped): those nobody holds are free again, the others free when released."""
        self.allocator.drop_cached()
        self._page_of.clear()
        self._key_of.clear()
        self._pending.clear()

    # The allocator's questions (PageCache).
    def keeps(self, page: int) -> bool:
        return page in self._key_of and page not in self._pending

    def forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._page_of[key]
        self._pending.discard(page)
