"""The shortest completion of a constraint from a matcher state: what budget-aware structured
output (docs/decoding.md, "Structured output") keeps in hand so that a constrained response
always ends complete within its ``max_tokens``.

llguidance gives token masks, not the grammar's states, so the completion is searched: a
uniform-cost search over token sequences from the state, whose edges are the grammar's forced
tokens when it forces any (one edge, as many tokens as they are), else one representative
token per first byte among the allowed ones (the shortest: a free string or a number is
completed byte by byte). Two states reached with the same number of tokens and the same next
mask are taken to be the same (their completions are searched once). The result is always a
real completion — every token of it went through the matcher — and is the shortest one up to
that merging; a search that exceeds ``MAX_SEARCH_STATES`` states gives up (None).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

import numpy as np

# States a search may evaluate (each a matcher copy, a token and a mask): bounds its time
# (about 25 µs a state for a small vocabulary, a few hundred for a 150k one).
MAX_SEARCH_STATES = 20_000


class TokenTable:
    """The vocabulary as the search reads it: every token id with bytes, ordered by (first
    byte, length, id), and where each first byte's run starts in that order."""

    def __init__(self, tokens: list[bytes]):
        first = np.array([t[0] if t else -1 for t in tokens], dtype=np.int16)
        length = np.array([len(t) for t in tokens], dtype=np.int32)
        ids = np.flatnonzero(first >= 0)  # special tokens (no bytes) are never candidates
        self.order = ids[np.lexsort((ids, length[ids], first[ids]))]
        self.first_byte = first[self.order]
        self.vocab_size = len(tokens)

    def representatives(self, mask: bytes) -> np.ndarray:
        """The allowed tokens of ``mask`` (llguidance's bitmask), one per first byte: the
        shortest (the lowest id among equals), in first-byte order; an escape or a non-ASCII
        first byte only when nothing else is allowed (neither shortens a completion where a
        plain byte would do)."""
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.zeros(self.vocab_size, dtype=bool)
        n = min(len(bits), self.vocab_size)
        allowed[:n] = bits[:n]
        hit = np.flatnonzero(allowed[self.order])  # allowed positions in (byte, length) order
        first = self.first_byte[hit]
        keep = np.ones(len(hit), dtype=bool)
        keep[1:] = first[1:] != first[:-1]  # each byte's first allowed: its shortest
        ids, first = self.order[hit[keep]], first[keep]
        plain = (first != ord("\\")) & (first < 0x80)
        return ids[plain] if plain.any() else ids


def shortest_completion(matcher, table: TokenTable, limit: int,
                        max_states: int = MAX_SEARCH_STATES) -> list[int] | None:
    """Tokens after which ``matcher`` (left unchanged) accepts, at most ``limit`` of them;
    [] if it accepts already; None if the search finds none within ``limit`` tokens (or runs
    past ``max_states``)."""
    if matcher.is_accepting() or matcher.is_stopped():
        return []
    if limit <= 0:
        return None
    tie = itertools.count()  # equal costs pop in the order pushed: the search is deterministic
    frontier = [(0, next(tie), matcher, _mask_of(matcher), 0, [])]
    seen: set[tuple[int, int]] = set()
    states = 0
    while frontier:
        cost, _, m, mask, trace, path = heapq.heappop(frontier)
        if m.is_accepting() or m.is_stopped():
            return path
        forced = m.compute_ff_tokens()
        edges = [forced] if forced else [[int(t)] for t in table.representatives(mask)]
        children = []
        for edge in edges:
            if cost + len(edge) > limit:
                continue
            states += 1
            if states > max_states:
                return None
            child = m.deep_copy()
            if child.consume_tokens(edge):
                children.append((edge, child, _mask_of(child)))
        loops = Counter(c_mask for _, _, c_mask in children if c_mask == mask)
        for edge, child, child_mask in children:
            # The masks the path went through, where content runs (several tokens looping
            # on one mask: a string's characters, a number's digits) count once: with the
            # cost, what tells two states apart (the run's length is in the cost).
            free = child_mask == mask and loops[child_mask] > 1
            child_trace = trace if free else hash((trace, child_mask))
            key = (cost + len(edge), child_trace)
            if key in seen:
                continue
            seen.add(key)
            heapq.heappush(frontier, (cost + len(edge), next(tie), child, child_mask,
                                      child_trace, path + edge))
    return None


def _mask_of(matcher) -> bytes:
    return b"" if matcher.is_accepting() or matcher.is_stopped() else matcher.compute_bitmask()
