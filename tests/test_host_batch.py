"""The runner's host work: the C++ extension matches the Python reference exactly.

Random batches of random requests (prompt and block lengths, cache modes, rules, temperatures,
Dream's shift, EOS stops) are driven to completion by both implementations side by side; every
packed array and every request's state must be identical after every iteration.
"""

import copy
import dataclasses
import os
import random

import numpy as np
import pytest

# tests/test_engine.py runs with the default implementation (the extension, when built); its
# tests are collected here a second time, with the Python path forced by _python_path below.
from test_engine import (  # noqa: F401
    loaded,
    test_batch_invariance_matches_reference,
    test_batches_are_actually_mixed,
    test_no_page_leaks_with_aborts,
    test_rejections_change_nothing,
)

from sangam.decoding.state import DecodeState
from sangam.engine import host_batch
from sangam.engine.host_batch import (
    CHostBatcher,
    PackedBatch,
    PythonHostBatcher,
    cext_available,
    default_impl,
)
from sangam.sampling_params import SamplingParams

VOCAB = 100
MASK = 99

needs_cext = pytest.mark.skipif(not cext_available(), reason="sangam._host is not built")


@pytest.fixture(autouse=True)
def _python_path(monkeypatch):
    monkeypatch.setenv("SANGAM_NO_CEXT", "1")


def test_extension_is_built_in_ci():
    if os.environ.get("CI") and not cext_available():
        pytest.fail("CI has a compiler, so sangam._host must be built (pip install -e .)")


def test_env_var_selects_the_implementation(monkeypatch):
    assert default_impl() == "python"
    monkeypatch.delenv("SANGAM_NO_CEXT")
    assert default_impl() == ("cext" if cext_available() else "python")
    monkeypatch.setenv("SANGAM_NO_CEXT", "0")
    assert default_impl() == ("cext" if cext_available() else "python")
    monkeypatch.setattr(host_batch, "_host", None)
    assert default_impl() == "python"


# Random workloads.
def _random_state(rng: random.Random) -> DecodeState:
    params = SamplingParams(
        max_tokens=rng.randint(1, 40), block_length=rng.choice([1, 2, 3, 4, 8, 16]),
        unmasking=rng.choice(["threshold", "factor", "topk"]),
        threshold=rng.choice([0.5, 0.9, 1.0]), factor=rng.choice([0.5, 1.0, 2.0]),
        tokens_per_step=rng.randint(1, 4), cache=rng.choice(["dual", "prefix", "none"]),
        temperature=rng.choice([0.0, 0.0, 0.7, 2]), stop_at_eos=rng.random() < 0.7,
        stop_token_ids=rng.choice([(), (), (3,), (3, 4)]))
    if params.cache != "none":  # refresh cadences: blocks start fully, response-only or cached
        params = dataclasses.replace(params, refresh_interval=rng.choice([1, 1, 2, 3]),
                                     prompt_refresh_interval=rng.choice([1, 2]),
                                     refresh_confidence=rng.choice([0.0, 0.5, 0.95]))
    if params.unmasking == "threshold" and rng.random() < 0.3:  # load-adaptive
        params = dataclasses.replace(params, min_threshold=params.threshold * rng.random())
    prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 5, 17, 40]))]
    seed = rng.choice([0, rng.getrandbits(63), 2**64 + rng.getrandbits(40)])
    stop_ids = rng.choice([frozenset(), frozenset({1}), frozenset({1, 2})])
    suffix = [rng.randrange(MASK) for _ in range(rng.choice([0, 0, 3]))]  # infilling
    if rng.random() < 0.25:  # block-causal (SDAR): grid-aligned blocks, no cadence or suffix
        params = dataclasses.replace(params, cache="dual", refresh_interval=1,
                                     prompt_refresh_interval=1, refresh_confidence=0.0)
        if rng.random() < 0.5:  # token editing (LLaDA2.1)
            params = dataclasses.replace(params, edit_threshold=rng.choice([0.0, 0.5, 0.9]),
                                         max_post_steps=rng.choice([0, 1, 3]))
        return DecodeState(prompt, params, MASK, stop_ids, False, seed, block_causal=True)
    return DecodeState(prompt, params, MASK, stop_ids, rng.random() < 0.5, seed, suffix)


def _maybe_chunk(rng: random.Random, copies: list[DecodeState]) -> None:
    """What the scheduler may decide for a block-causal request about to prefill: a chunk of
    its prompt's whole blocks (the same on every copy)."""
    st = copies[0]
    b = st.params.block_length
    c = st.cursor
    room = (c.block_origin - c.prefilled) // b
    if c.block_causal and c.block == 0 and c.step == 0 and room and rng.random() < 0.5:
        end = c.prefilled + b * rng.randint(1, room)
        for c in copies:
            c.chunk_end = end


def _random_pages(rng: random.Random, st: DecodeState, page_size: int) -> list[int]:
    n = -(-st.cursor.total_len // page_size) + rng.choice([0, 0, 3])
    return rng.sample(range(100_000), n)


def _scores(rng: random.Random, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (stop ids among them; never the mask, as the scorer guarantees) and confidences
    with many exact ties and values on the rules' boundaries (threshold, 1 - f/(k+1))."""
    tokens = np.array([rng.choice([1, 2]) if rng.random() < 0.05 else rng.randrange(MASK)
                       for _ in range(m)], dtype=np.int64)
    ties = [0.0, 0.25, 0.5, 0.9, 1.0, 1 - 1 / 3, 1 - 0.5 / 3, 1 - 2 / 5, 1 - 1 / 4, 0.875]
    conf = np.array([rng.choice(ties) if rng.random() < 0.5 else rng.random()
                     for _ in range(m)], dtype=np.float64)
    return tokens, conf


def _assert_same_batch(a: PackedBatch, b: PackedBatch) -> None:
    for name in PackedBatch.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def _assert_same_state(a: DecodeState, b: DecodeState) -> None:
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.confidence, b.confidence)
    assert a.record == b.record  # the counters, post_steps among them
    for name in ("block", "step", "force_refresh", "prefilled", "chunk_end"):
        x, y = getattr(a.cursor, name), getattr(b.cursor, name)
        assert (x, type(x)) == (y, type(y)), name
    for name in ("num_forwards", "finished", "finish_reason", "num_chunks"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x, type(x)) == (y, type(y)), name


def _naive_pack(states, pages, page_size) -> PackedBatch:
    """PackedBatch straight from docs/design.md §2, one request at a time (checks from_plans)."""
    plans = [st.plan() for st in states]
    width = max(len(pg) for pg in pages)
    cols = {name: [] for name in PackedBatch.__dataclass_fields__}
    tables, cu_q, cu_rows = [], [0], [0]
    for st, plan, pg in zip(states, plans, pages):
        span = range(plan.span_start, plan.span_end)
        cols["positions"] += span
        cols["input_ids"] += [st.tokens[p] for p in span]
        cols["slot_mapping"] += [pg[p // page_size] * page_size + p % page_size for p in span]
        tables.append(list(pg) + [0] * (width - len(pg)))
        cols["kv_lens"].append(plan.span_end if st.cursor.block_causal else st.cursor.total_len)
        cols["logits_indices"] += [cu_q[-1] + r for r in plan.rows]
        cols["row_keys"] += list(plan.row_keys)
        cols["temperatures"] += [st.params.temperature] * len(plan.rows)
        cols["cand_positions"] += list(plan.positions)
        cols["num_forced"].append(plan.num_forced)
        cols["num_editable"].append(plan.num_editable)
        cu_q.append(cu_q[-1] + len(span))
        cu_rows.append(cu_rows[-1] + len(plan.rows))
    dtypes = {"block_tables": np.int32, "cu_seqlens_q": np.int32, "kv_lens": np.int32,
              "temperatures": np.float64}
    cols.update(block_tables=tables, cu_seqlens_q=cu_q, cu_rows=cu_rows)
    return PackedBatch(**{k: np.array(v, dtype=dtypes.get(k, np.int64)).reshape(
        (len(states), width) if k == "block_tables" else -1) for k, v in cols.items()})


def _drive(seed: int, num_states: int, batchers: list) -> int:
    """Run ``num_states`` random requests to completion through every batcher at once (each on
    its own copy of the states), staggered and in random subsets, checking after every
    iteration that all copies agree. Returns the number of iterations."""
    rng = random.Random(seed)
    page_size = batchers[0].page_size
    pending = [_random_state(rng) for _ in range(num_states)]
    live = []  # (pages, [one copy of the state per batcher])
    iterations = 0
    while pending or live:
        for _ in range(rng.randint(0, 4)):
            if pending:
                st = pending.pop()
                live.append((_random_pages(rng, st, page_size),
                             [copy.deepcopy(st) for _ in batchers]))
        if not live:
            continue
        picked = rng.sample(live, rng.randint(1, len(live)))
        for _, copies in picked:
            _maybe_chunk(rng, copies)
        pages = [pg for pg, _ in picked]
        built = [b.build([copies[i] for _, copies in picked], pages)
                 for i, b in enumerate(batchers)]
        for other in built:
            _assert_same_batch(built[0], other)
        tokens, conf = _scores(rng, built[0].num_rows)
        done = [b.apply([copies[i] for _, copies in picked], batch, tokens, conf)
                for i, (b, batch) in enumerate(zip(batchers, built))]
        assert all(d == done[0] for d in done)
        for _, copies in picked:
            for c in copies[1:]:
                _assert_same_state(copies[0], c)
        live = [(pg, copies) for pg, copies in live if not copies[0].finished]
        iterations += 1
    return iterations


@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 4), (2, 16), (3, 4)])
def test_python_packing_matches_naive_reference(seed, page_size):
    rng = random.Random(seed)
    states = [_random_state(rng) for _ in range(40)]
    for st in states[::3]:  # some mid-block, cached steps
        batch = PythonHostBatcher(page_size).build([st], [_random_pages(rng, st, page_size)])
        st.apply(st.plan(), *_scores(rng, batch.num_rows))
    states = [st for st in states if not st.finished]
    pages = [_random_pages(rng, st, page_size) for st in states]
    _assert_same_batch(PythonHostBatcher(page_size).build(states, pages),
                       _naive_pack(states, pages, page_size))


@needs_cext
@pytest.mark.parametrize("seed,page_size", [(10, 1), (11, 4), (12, 16), (13, 4), (14, 16)])
def test_cext_matches_python(seed, page_size):
    iterations = _drive(seed, 80, [PythonHostBatcher(page_size), CHostBatcher(page_size)])
    assert iterations > 50


def _scrambled_state(rng: random.Random) -> DecodeState:
    """A random state at any block and step, its current block masked at random: covers what
    driving from the start rarely reaches (e.g. Dream's first position masked mid-block)."""
    st = _random_state(rng)
    st.cursor.block = rng.randrange(st.cursor.num_blocks)
    st.cursor.step = rng.choice([0, 1, 2, 7])
    st.num_forwards = rng.randrange(50)
    s, e = st.cursor.block_bounds()
    p = st.cursor.prompt_len
    st.tokens[p:s] = [rng.randrange(MASK) for _ in range(s - p)]
    st.tokens[s:e] = [rng.choice([MASK, MASK, 1, rng.randrange(MASK)]) for _ in range(e - s)]
    if rng.random() < 0.5:
        st.tokens[s] = MASK
    st.cursor.force_refresh = rng.random() < 0.2  # taken back: the block refreshes fully
    st.cursor.step, saved = 0, st.cursor.step
    st.set_load(rng.random())  # a load-adaptive request's block threshold
    st.cursor.step = saved
    return st


@needs_cext
@pytest.mark.parametrize("seed", [20, 21])
def test_cext_matches_python_on_arbitrary_states(seed):
    rng = random.Random(seed)
    py, cx = PythonHostBatcher(4), CHostBatcher(4)
    for _ in range(100):
        states = [_scrambled_state(rng) for _ in range(rng.randint(1, 6))]
        twins = copy.deepcopy(states)
        pages = [_random_pages(rng, st, 4) for st in states]
        a, b = py.build(states, pages), cx.build(twins, pages)
        _assert_same_batch(a, b)
        tokens, conf = _scores(rng, a.num_rows)
        if len(tokens):  # a committed mask (no scorer emits one) must not break parity either
            tokens[rng.randrange(len(tokens))] = MASK
        assert py.apply(states, a, tokens, conf) == cx.apply(twins, b, tokens, conf)
        for x, y in zip(states, twins):
            _assert_same_state(x, y)


@needs_cext
def test_cext_arena_grows_and_views_stay_right():
    rng = random.Random(5)
    py, cx = PythonHostBatcher(4), CHostBatcher(4)
    for n in (1, 300, 2, 600):  # refreshes of hundreds of requests overflow the first arena
        states = [_random_state(rng) for _ in range(n)]
        pages = [_random_pages(rng, st, 4) for st in states]
        _assert_same_batch(py.build(states, pages), cx.build(states, pages))


@needs_cext
def test_cext_errors_like_python():
    st = DecodeState([5, 6, 7], SamplingParams(max_tokens=8, block_length=4), MASK,
                     frozenset({1}), False)
    short = [[0]]  # the canvas spans 11 positions: 3 pages of 4
    for batcher in (PythonHostBatcher(4), CHostBatcher(4)):
        with pytest.raises(IndexError):
            batcher.build([st], short)
        with pytest.raises(ValueError):
            batcher.build([], [])
