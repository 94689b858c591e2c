"""Prefix caching for block-causal models (docs/design.md §4, Prefix caching): the allocator's
shared and cached pages, the keys, the scheduler's use of them under random arrivals, aborts,
failures and evictions (a model of what each page holds checks every hit), and the engine's
tokens with caching on against off (float64), its counters and the server's usage."""

from __future__ import annotations

import random

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import mk
from test_sdar import SDAR
from test_serve_openai import MODEL, serve_in_thread

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.engine.engine import Engine
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.block_cursor import BlockCursor
from sangam.sched.config import SchedulerConfig
from sangam.sched.page_allocator import OutOfPagesError, PageAllocator
from sangam.sched.prefix_cache import PrefixCache, extend_page_keys, prefix_page_keys
from sangam.sched.request import Request, RequestStatus, StepOutcome
from sangam.testing import make_tiny_checkpoint


# The allocator and the cache.
def test_shared_pages_are_freed_once_per_holder_and_cached_ones_reclaimed_last():
    a = PageAllocator(4)
    cache = PrefixCache(a)
    x = a.allocate(2)
    keys = [b"k0", b"k1"]
    assert cache.publish(keys, x) == x
    assert cache.match(keys) == ([], True)  # pending: its forward runs in this batch
    cache.ready(x)
    assert cache.match(keys) == (x, False) and cache.match([b"k0", b"zz"]) == (x[:1], False)
    a.share(x)  # a second request hits both
    a.free(x)
    assert (a.refs(x[0]), a.num_used) == (1, 2)
    a.free(x)  # the last holder: they stay cached, counted free
    assert (a.num_used, a.num_free, a.num_cached_free) == (0, 4, 2)
    assert cache.match(keys) == (x, False)
    with pytest.raises(ValueError):
        a.free([x[0]])  # nobody holds it
    y = a.allocate(2)  # the plain free pages go first
    assert not set(y) & set(x) and cache.match(keys) == (x, False)
    a.share([x[1]])  # a hit takes a cached page back out of the reclaimable ones
    z = a.allocate(1)  # reclaims the one left, x[0]: its key is gone
    assert z == [x[0]] and cache.match(keys) == ([], False) and len(cache) == 1
    with pytest.raises(OutOfPagesError):
        a.allocate(1)
    a.free(y + z + [x[1]])
    assert a.num_free == 4


def test_a_pending_page_whose_owner_fails_is_dropped():
    a = PageAllocator(2)
    cache = PrefixCache(a)
    x = a.allocate(1)
    cache.publish([b"k"], x)
    a.free(x)  # its forward failed: the request ended and freed its pages
    assert len(cache) == 0 and a.num_cached_free == 0 and a.num_free == 2


def test_a_page_key_covers_its_whole_block():
    """Pages of 4 tokens in blocks of 8: page 0's K/V depends on tokens 4..7 too."""
    base = list(range(10, 26))
    keys = prefix_page_keys(base, 16, 4, 8)
    assert len(keys) == 4 and len(set(keys)) == 4
    changed = base[:6] + [99] + base[7:]  # token 6: block 0, page 1
    other = prefix_page_keys(changed, 16, 4, 8)
    assert other[0] != keys[0] and other[1] != keys[1]
    later = base[:12] + [99] + base[13:]  # token 12: block 1 only
    assert prefix_page_keys(later, 16, 4, 8)[:2] == keys[:2]
    assert prefix_page_keys(base, 16, 4, 4)[0] != keys[0]  # another block length
    with pytest.raises(ValueError):
        prefix_page_keys(base, 12, 4, 8)


# The scheduler, driven over random traffic: a model of every page's contents checks each hit.
BASES = [[random.Random(s).randrange(3, 50) for _ in range(160)] for s in range(3)]
REQ = st.tuples(
    st.integers(0, 20),  # iteration at which it is added
    st.integers(0, 2),  # its prompt's base text, which its response continues
    st.integers(1, 96),  # prompt length (a prefix of the base)
    st.integers(1, 3),  # blocks
    st.integers(0, 3),  # a private tail: tokens of its own after the shared prefix
)


def _block_causal(rid: str, t: float, prompt: list[int], blocks: int, block: int,
                  page_size: int, response: list[int] = ()) -> Request:
    """A block-causal request whose committed response is ``response`` (then filler): ``seq``,
    what its canvas holds once decoded."""
    canvas = blocks * block - len(prompt) % block  # ends on the grid
    cursor = BlockCursor(len(prompt), canvas, block, block_causal=True)
    r = Request(rid, t, cursor)
    r.page_keys = prefix_page_keys(prompt, cursor.block_origin, page_size, block)
    r.seq = (prompt + list(response) + [2] * canvas)[:cursor.total_len]
    return r


@settings(max_examples=120, deadline=None)
@given(specs=st.lists(REQ, min_size=1, max_size=20),
       page_size=st.sampled_from([2, 4, 8, 16]), block=st.sampled_from([4, 8]),
       extra=st.integers(0, 30), tau=st.sampled_from([16, 64, 1000]),
       chunked=st.booleans(), seed=st.integers(0, 2**32 - 1),
       abort_prob=st.sampled_from([0.0, 0.1]),
       policy=st.sampled_from(["deficit", "fastdllm"]))
def test_property_hits_hold_the_right_kv_and_nothing_leaks(specs, page_size, block, extra, tau,
                                                           chunked, seed, abort_prob, policy):
    """Random arrivals of prompts sharing prefixes (a response continues its base text, so
    a later prompt may start with an earlier response: a conversation's next turn), aborts
    anywhere (in flight too: a failed forward's request is dropped the same way), pools small
    enough to reclaim cached pages."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _, base, length, _, tail in specs:
        prompts.append(BASES[base][:length] + [rng.randrange(50, 60) for _ in range(tail)])
        responses.append([] if tail else BASES[base][length:])
    most = max(-(-(len(p) + 4 * block) // page_size) for p in prompts)
    alloc = PageAllocator(most + extra)
    cache = PrefixCache(alloc)
    b = BatchBuilder(alloc, SchedulerConfig(page_size=page_size, token_budget=tau,
                                            chunked_prefill=chunked, policy=policy), cache)
    # What each page slot holds: (position, the tokens of its block) when the forward whose
    # span covered it wrote its final K/V (its block before the current one), else None.
    slots: dict[tuple[int, int], tuple] = {}
    reqs: list[Request] = []
    arrivals: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault(spec[0], []).append(i)
    it = 0
    while it <= max(arrivals) or b.has_work:
        for i in arrivals.get(it, []):
            r = _block_causal(f"r{i}", float(it), prompts[i], specs[i][3], block, page_size,
                              responses[i])
            reqs.append(r)
            b.add(r)
        if abort_prob and reqs and rng.random() < abort_prob:
            b.abort(rng.choice(reqs).request_id)
        batch = b.schedule(float(it))
        for r in batch.prefills:  # a hit's pages hold exactly its prompt's blocks' K/V
            for pos in range(r.cursor.prefilled):
                page = r.pages[pos // page_size]
                blk = pos - pos % block
                assert slots[page, pos % page_size] == (pos, tuple(r.seq[blk:blk + block]))
                assert alloc.refs(page) >= 1
        for r in batch.requests:
            start, end = r.cursor.span()
            current = r.cursor.block_bounds()[0]
            for pos in range(start, end):  # it writes only pages of its own, not cached ones
                page = r.pages[pos // page_size]
                assert alloc.refs(page) == 1 and not cache.keeps(page), (r, pos)
                blk = pos - pos % block
                final = blk + block <= current
                slots[page, pos % page_size] = (pos, tuple(r.seq[blk:blk + block])) if final \
                    else None
        for r in batch.requests:
            if abort_prob and rng.random() < abort_prob:
                b.abort(r.request_id)
                continue
            if r.chunk_admitted:
                r.cursor.store_chunk()
                b.step_done(r, float(it), StepOutcome())
                continue
            block_done = rng.random() < 0.5
            finished = block_done and r.cursor.block + 1 == r.cursor.num_blocks
            r.cursor.advance(block_done, finished)
            if block_done and not finished:  # as the worker does: the finished blocks' keys
                extend_page_keys(r.page_keys, r.seq, r.cursor.block_bounds()[0], page_size,
                                 block)
            b.step_done(r, float(it), StepOutcome(block_done, finished))
        held = [r for r in reqs if r.status is not RequestStatus.FINISHED]
        holders: dict[int, int] = {}
        for r in held:
            if r.pages:
                assert len(r.pages) == r.cursor.num_pages(page_size)
            for p in r.pages:
                holders[p] = holders.get(p, 0) + 1
        assert all(alloc.refs(p) == n for p, n in holders.items())
        assert alloc.num_used == len(holders)  # no page leaks, shared ones counted once
        it += 1
        assert it < 3000, "the builder stopped making progress"
    assert all(r.status is RequestStatus.FINISHED and not r.pages for r in reqs)
    assert alloc.num_free == alloc.num_pages
    assert cache.hits <= cache.queries


def test_identical_prompts_arriving_together_prefill_once():
    """The second waits one iteration for the first's pending pages, then shares them."""
    alloc = PageAllocator(64)
    b = BatchBuilder(alloc, SchedulerConfig(page_size=4, token_budget=1000), PrefixCache(alloc))
    prompt = list(range(3, 30))  # 27 tokens: block 0 starts at 24
    r1, r2 = (_block_causal(f"r{i}", 0.0, prompt, 2, 8, 4) for i in (1, 2))
    b.add(r1)
    b.add(r2)
    first = b.schedule(0.0)
    assert first.prefills == [r1] and first.prefill_tokens == 32
    r1.cursor.advance(False, False)
    b.step_done(r1, 0.0, StepOutcome())
    second = b.schedule(1.0)
    assert second.prefills == [r2] and second.prefill_tokens == 8  # only block 0's span
    assert r2.cached_tokens == 24 and r2.pages[:6] == r1.pages[:6]
    assert (b.prefix_cache.queries, b.prefix_cache.hits) == (54, 24)


def test_bidirectional_requests_never_look_up():
    alloc = PageAllocator(64)
    b = BatchBuilder(alloc, SchedulerConfig(page_size=4), PrefixCache(alloc))
    b.add(mk("bi", 0.0, P=8, G=16, B=8))
    batch = b.schedule(0.0)
    assert batch.prefill_tokens == 24 and b.prefix_cache.queries == 0


# The engine: float64 tokens with caching on equal those with it off.
@pytest.fixture(scope="module")
def sdar_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sdar-cache"), seed=5, **SDAR)


def _engine(path: str, caching: bool, **kw) -> Engine:
    return Engine(EngineConfig(model=path, device="cpu", dtype="float64", page_size=4,
                               enable_prefix_caching=caching, **kw))


def _workload(seed: int, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts sharing 0-100% of a system prompt, some asked again (multi-turn-like)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 150) for _ in range(40)]
    out = []
    for i in range(n):
        shared = system[:rng.choice([0, 4, 8, 17, 24, 33, 40])]
        prompt = shared + [rng.randrange(3, 150) for _ in range(rng.randrange(1 if shared
                                                                              else 2, 12))]
        params = SamplingParams(max_tokens=rng.choice([4, 8, 12]), block_length=4,
                                stop_at_eos=False, seed=i)
        out.append((f"q{i}", prompt, params))
    return out


def _run(engine: Engine, work, abort: set[str] = frozenset(), stagger: int = 3) -> dict:
    """Add the requests a few per iteration, abort ``abort`` after their first block; the
    finished outputs by id."""
    pending = list(work)
    done = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        for rid, prompt, params in pending[:stagger]:
            engine.add_request(rid, prompt, params)
        pending = pending[stagger:]
        for out in engine.step():
            if out.request_id in abort and not out.finished:
                engine.abort_request(out.request_id)
            elif out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < 5000
    return done


def test_tokens_equal_with_caching_on_and_off_under_evictions_and_aborts(sdar_path):
    work = _workload(0, 40)
    off = _run(_engine(sdar_path, False), work)
    abort = {rid for rid, *_ in work[::7]}
    for num_pages in (None, 48):  # the default pool, and one so small it must reclaim
        engine = _engine(sdar_path, True, num_pages=num_pages)
        on = _run(engine, work, abort)
        for rid, out in on.items():
            if rid not in abort:
                assert out.token_ids == off[rid].token_ids, rid
        cache = engine.builder.prefix_cache
        assert cache.hits > 0 and engine.pool.allocator.num_used == 0
        assert all(engine.pool.allocator.refs(p) == 0 for p in range(engine.pool.num_pages))
        hits = [o.num_cached_tokens for o in on.values()]
        assert all(h is not None and h % 4 == 0 for h in hits) and max(hits) >= 32
        if num_pages:
            assert engine.pool.allocator.num_cached_free <= num_pages


def test_n_samples_prefill_their_prompt_once(sdar_path):
    prompt = list(range(5, 41))  # 36 tokens: 9 whole blocks
    params = SamplingParams(max_tokens=8, block_length=4, stop_at_eos=False, n=6, seed=1,
                            temperature=0.8)
    runs = {}
    for caching in (False, True):
        llm = LLM(sdar_path, device="cpu", dtype="float64", page_size=4,
                  enable_prefix_caching=caching)
        llm.engine.stats.iterations.clear()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
        runs[caching] = ([o.token_ids for o in out.outputs],
                         sum(it.prefill_tokens for it in llm.engine.stats.iterations),
                         [o.num_cached_tokens for o in [out, *out.siblings]])
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 6 * 40 and runs[True][1] == 40 + 5 * 4  # the prompt once
    assert runs[True][2] == [0, 36, 36, 36, 36, 36] and runs[False][2] == [None] * 6


def test_a_conversations_next_turn_finds_its_earlier_turns_cached(sdar_path):
    """A response's finished blocks are cached as they end: a next turn whose prompt is the
    first turn's prompt and response (and more) hits past the first prompt."""
    params = SamplingParams(max_tokens=16, block_length=4, stop_at_eos=False, seed=3)
    first_prompt = list(range(5, 27))  # 22 tokens: block 0 starts at 20
    outs = {}
    for caching in (False, True):
        engine = _engine(sdar_path, caching)
        first = _run(engine, [("t1", first_prompt, params)])["t1"]
        turn = first_prompt + first.token_ids + [7, 8, 9]
        outs[caching] = (first.token_ids, _run(engine, [("t2", turn, params)])["t2"])
    assert outs[True][0] == outs[False][0]
    assert outs[True][1].token_ids == outs[False][1].token_ids
    # Blocks ending by position 36 were final when the first turn finished (its last block,
    # [36, 40), never is): 36 tokens, pages of 4.
    assert outs[True][1].num_cached_tokens == 36 > 20


def test_prefix_caching_is_refused_for_bidirectional_models(llada_path):
    with pytest.raises(ValueError, match="block-causal"):
        Engine(EngineConfig(model=llada_path, device="cpu", enable_prefix_caching=True))


def test_server_reports_cached_tokens_and_counters(sdar_path):
    system = list(range(5, 37))  # 32 tokens
    body = dict(model=MODEL, max_tokens=4, block_length=4, stop_at_eos=False)
    with serve_in_thread(sdar_path) as url:  # pages of 16 tokens
        with httpx.Client(base_url=url, timeout=60) as http:
            first = http.post("/v1/completions", json={**body, "prompt": system + [40, 41]})
            again = http.post("/v1/completions", json={**body, "prompt": system + [42]})
            metrics = http.get("/metrics").text
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert "sangam_prefix_cache_queries_total 67.0" in metrics
    assert "sangam_prefix_cache_hits_total 32.0" in metrics
