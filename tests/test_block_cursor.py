"""BlockCursor: the one definition of a request's spans and refresh cadence (docs/design.md
§1.2, §2), checked against the rules as the design states them."""

from __future__ import annotations

import itertools
import pickle

import pytest

from sangam.sampling_params import SamplingParams
from sangam.sched.block_cursor import FULL_REFRESH, NO_REFRESH, RESPONSE_REFRESH, BlockCursor


def test_spans_follow_the_design():
    # P = 10, canvas 24 (3 blocks of 8), suffix 2: T = 36; block b at [10 + 8b, 18 + 8b).
    dual = BlockCursor(10, 24, 8, suffix_len=2)
    assert (dual.total_len, dual.num_blocks, dual.block_bounds()) == (36, 3, (10, 18))
    assert dual.span() == (0, 36) and dual.span(1) == (10, 18)  # refresh, then the block
    prefix = BlockCursor(10, 24, 8, suffix_len=2, cache="prefix")
    assert prefix.span(1) == (10, 36) and prefix.span(1, 2) == (26, 36)  # block + the rest
    none = BlockCursor(10, 24, 8, cache="none")
    assert none.span(3, 1) == (0, 34)  # every step a refresh
    # Cadence 2 x 2: blocks start full, cached, response-only, cached.
    cadence = BlockCursor(10, 32, 8, refresh_interval=2, prompt_refresh_interval=2, shift=1)
    assert [cadence.block_refresh(b) for b in range(4)] == [
        FULL_REFRESH, NO_REFRESH, RESPONSE_REFRESH, NO_REFRESH]
    assert cadence.span(0, 2) == (10, 42)  # response-only: [P, T)
    assert cadence.span(0, 1) == (17, 26)  # cached first step: row s - 1 predicts s
    cadence.block, cadence.force_refresh = 1, True
    assert cadence.block_start == FULL_REFRESH and cadence.span() == (0, 42)
    # Block-causal: blocks on the grid from 0 (P = 10, B = 4: block 0 is [8, 12)).
    causal = BlockCursor(10, 6, 4, block_causal=True)
    assert (causal.block_origin, causal.num_blocks, causal.span()) == (8, 2, (0, 12))
    assert causal.chunk_room(5) == 4 and causal.chunk_room(100) == 8
    causal.admit_chunk(4)
    assert causal.span() == (0, 4) and causal.keys_attended(4) == 4
    causal.store_chunk()
    assert (causal.prefilled, causal.chunk_end, causal.span()) == (4, None, (4, 12))
    causal.advance(block_done=True, finished=False)
    assert causal.span() == (8, 16) and causal.decode_span == 8  # stores block 0, steps 1
    causal.lose_cache()
    assert causal.span() == (0, 16) and causal.prefilled == 0


@pytest.mark.parametrize("cache,cadence,shift,causal", [
    (cache, cadence, shift, False) for cache, cadence, shift in itertools.product(
        ["dual", "prefix", "none"], [(1, 1), (2, 1), (2, 3)], [0, 1])
    if cache != "none" or cadence == (1, 1)] + [("dual", (1, 1), 0, True)])
def test_decode_span_is_the_next_cached_steps_span(cache, cadence, shift, causal):
    """``decode_span`` (read for every seated request at every iteration, with a fast path) is
    the length of the current block's next cached step, by ``span`` itself."""
    c = BlockCursor(13, 43 if causal else 40, 8, cache=cache, refresh_interval=cadence[0],
                    prompt_refresh_interval=cadence[1], shift=shift, block_causal=causal)
    for block, step, force in itertools.product(range(c.num_blocks), range(3), [False, True]):
        c.block, c.step, c.force_refresh = block, step, force
        cached = step or c.block_start == NO_REFRESH
        start, end = c.span(None if cached else 1)
        assert c.decode_span == end - start, (block, step, force)


def test_moves_and_copies():
    c = BlockCursor(4, 8, 4)
    c.advance(block_done=False, finished=False)
    assert (c.block, c.step) == (0, 1)
    c.advance(block_done=True, finished=False, force_next=True)
    assert (c.block, c.step, c.force_refresh) == (1, 0, True)
    with pytest.raises(ValueError, match="must finish"):
        c.advance(block_done=True, finished=False)  # the last block ended
    twin = c.copy()
    twin.catch_up(0, 2, False)
    assert (c.block, c.step, twin.block, twin.step) == (1, 0, 0, 2)  # independent positions
    back = pickle.loads(pickle.dumps(c))
    assert back.record == c.record and back.total_len == c.total_len
    for bad in (dict(prompt_len=0, canvas_len=4, block_length=4),
                dict(prompt_len=3, canvas_len=6, block_length=4),
                dict(prompt_len=3, canvas_len=6, block_length=4, block_causal=True),
                dict(prompt_len=3, canvas_len=4, block_length=4, cache="paged")):
        with pytest.raises(ValueError):
            BlockCursor(**bad)


def _cached_spans(c: BlockCursor) -> set[int]:
    """Every span length a cached step (not a refresh) of ``c``'s request takes, by ``span``."""
    out = set()
    for block in range(c.num_blocks):
        if c.block_refresh(block) == NO_REFRESH:  # a block that starts from cached K/V
            start, end = c.span(0, block)
            out.add(end - start)
        if c.cache != "none":
            start, end = c.span(1, block)
            out.add(end - start)
    return out


@pytest.mark.parametrize("cache,cadence,shift,causal", [
    (cache, cadence, shift, False) for cache, cadence, shift in itertools.product(
        ["dual", "prefix", "none"], [(1, 1), (2, 1), (2, 3)], [0, 1])
    if cache != "none" or cadence == (1, 1)] + [("dual", (1, 1), 0, True)])
def test_the_memory_plan_and_graph_spans_are_the_spans_of_cached_steps(cache, cadence, shift,
                                                                       causal):
    """``longest_cached_span`` (the memory plan's bound) is at least every cached step's span,
    and equals the longest for DualCache; ``graph_spans`` (what CUDA graphs capture) are the
    spans of DualCache steps that start no block from a refresh."""
    for prompt in (1, 13, 40):
        c = BlockCursor.for_request(
            SamplingParams(max_tokens=37, block_length=8, cache=cache,
                           refresh_interval=cadence[0], prompt_refresh_interval=cadence[1]),
            prompt, shift=shift, block_causal=causal)
        spans = _cached_spans(c)
        bound = BlockCursor.longest_cached_span(8, cache, c.total_len, shift, causal)
        assert all(s <= bound for s in spans)
        if cache == "dual":
            assert bound == max(spans) or cadence == (1, 1) and bound == 8 + shift
            graphed = set(BlockCursor.graph_spans(8, causal))
            assert graphed <= spans and spans - graphed <= {8 + shift}


def test_canvas_and_blocks_of_a_request():
    """The canvas rules (bidirectional: max_tokens in whole blocks; block-causal: to the grid
    from position 0), the blocks that hold a response, and the masks each block starts with."""
    params = SamplingParams(max_tokens=30, block_length=8)
    assert BlockCursor.canvas_len(5, 30, 8) == 32
    assert BlockCursor.canvas_len(5, 30, 8, block_causal=True) == 35 and (5 + 35) % 8 == 0
    for prompt, causal in itertools.product(range(1, 20), (False, True)):
        c = BlockCursor.for_request(params, prompt, block_causal=causal)
        assert c.canvas_end - c.prompt_len <= BlockCursor.max_canvas_len(30, 8, causal)
        assert c.blocks_for(30) == c.num_blocks
        for n in range(1, 31):  # the blocks up to the one holding response position n - 1
            assert c.blocks_for(n) == c.block_of(prompt + n - 1) + 1
            s, e = c.block_bounds(c.blocks_for(n) - 1)
            assert s <= prompt + n - 1 < e
        masks = [c.block_masks(b) for b in range(c.num_blocks)]
        assert sum(masks) == c.canvas_end - c.prompt_len  # each canvas position once
        assert masks[1:] == [8] * (c.num_blocks - 1)
