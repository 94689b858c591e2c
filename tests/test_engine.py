"""The batched engine reproduces the single-request reference exactly (float64, CPU)."""

import dataclasses
import random
import types

import numpy as np
import pytest
import torch

from sangam import LLM
from sangam.config import EngineConfig
from sangam.engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes
from sangam.engine.engine import Engine
from sangam.engine.front import QueueFull, RequestRejected
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.reference_decoder import ReferenceDecoder
from sangam.engine.validation import new_state
from sangam.models import read_config
from sangam.sampling_params import SamplingParams
from sangam.testing import make_tiny_checkpoint

BIAS = {1: -100.0, 7: 3.0, 42: 1.5}  # EOS banned, two tokens favoured
RULES = [dict(unmasking="threshold", threshold=0.9), dict(unmasking="threshold", threshold=0.5),
         dict(unmasking="factor", factor=1.0), dict(unmasking="topk", tokens_per_step=2)]


@pytest.fixture(scope="module")
def loaded(llada_path, dream_path):
    return {arch: LoadedModel.load(EngineConfig(model=p, device="cpu", dtype="float64"))
            for arch, p in (("llada", llada_path), ("dream", dream_path))}


def _workload(n: int, seed: int, block_lengths=(4, 8), caches=("dual", "prefix", "none")):
    """Requests as ``Engine.add_request`` arguments: (id, prompt, params, arrival, suffix)."""
    rng = random.Random(seed)
    nucleus = random.Random(-seed)  # its own stream: the other fields stay as they were
    infill = random.Random(seed + 1000)  # another: suffixes (infilling) and priorities
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, 150) for _ in range(rng.choice([1, 5, 15, 16, 17, 31, 40]))]
        params = SamplingParams(
            max_tokens=rng.choice([8, 13, 24]), block_length=rng.choice(block_lengths),
            cache=rng.choice(caches), seed=i,
            temperature=rng.choice([0.0, 0.0, 2.0]), stop_at_eos=rng.random() < 0.5,
            logprobs=[None, 0, 3][i % 3], top_p=nucleus.choice([1.0, 0.9, 0.3]),
            top_k=nucleus.choice([0, 0, 4]), logit_bias=nucleus.choice([{}, {}, BIAS]),
            **_penalties(nucleus), min_p=nucleus.choice([0.0, 0.0, 0.2]),
            priority=infill.choice([0, 0, 1, -1]), **rng.choice(RULES))
        suffix = [infill.randrange(2, 150) for _ in range(infill.choice([0, 0, 1, 6]))]
        reqs.append((f"r{i}", prompt, params, None, suffix))
    return reqs


def _penalties(rng: random.Random) -> dict:
    """Penalties and min_tokens, each on in about a third of the requests."""
    return dict(presence_penalty=rng.choice([0.0, 0.0, 0.5]),
                frequency_penalty=rng.choice([0.0, 0.0, 0.7]),
                repetition_penalty=rng.choice([1.0, 1.0, 1.4]), min_tokens=rng.choice([0, 0, 6]))


_REFERENCE_CACHE = {}


def _reference(lm, reqs):
    key = (lm.path, tuple((rid, tuple(prompt), params, tuple(suffix))
                          for rid, prompt, params, _, suffix in reqs))
    if key not in _REFERENCE_CACHE:
        _REFERENCE_CACHE[key] = _decode_one_by_one(lm, reqs)
    return _REFERENCE_CACHE[key]


def _decode_one_by_one(lm, reqs):
    out = {}
    for rid, prompt, params, _, suffix in reqs:
        st = new_state(lm, prompt, params, random.Random(0), suffix)
        ReferenceDecoder(lm.model).run(st)
        tokens = st.output_token_ids()
        logprobs = st.output_logprobs(len(tokens)) if params.logprobs is not None else None
        top = st.output_top_logprobs(len(tokens)) if params.logprobs else None
        out[rid] = (tokens, st.num_forwards, logprobs, top)
    return out


def _assert_same(got, want):
    """Tokens, forwards and alternatives' ids exactly; log-probabilities to the last bits (a
    batched GEMM may round a row's logits differently from a one-request forward)."""
    assert {r: v[:2] for r, v in got.items()} == {r: v[:2] for r, v in want.items()}
    for rid, (_, _, logprobs, top) in want.items():
        assert (got[rid][2] is None) == (logprobs is None), rid
        if logprobs is not None:
            assert got[rid][2] == pytest.approx(logprobs, rel=1e-12, abs=1e-12), rid
        assert (got[rid][3] is None) == (top is None), rid
        if top is not None:
            assert [[t for t, _ in alt] for alt in got[rid][3]] == [[t for t, _ in alt]
                                                                    for alt in top], rid
            assert [lp for alt in got[rid][3] for _, lp in alt] == pytest.approx(
                [lp for alt in top for _, lp in alt], rel=1e-12, abs=1e-12), rid


def staggered_outputs(engine, reqs, rng: random.Random) -> dict:
    """Submit ``reqs`` (add_request's arguments) 0-3 at a time between iterations, as
    ``rng`` draws; each request's final output, by id."""
    pending = list(reqs)
    done = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                engine.add_request(*pending.pop(0))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _run_staggered(engine, reqs, seed):
    """Submit requests a few at a time between iterations; collect final outputs."""
    return {rid: (o.token_ids, o.num_forwards, o.logprobs, o.top_logprobs)
            for rid, o in staggered_outputs(engine, reqs, random.Random(seed)).items()}


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("policy,budget", [("deficit", 64), ("deficit", 1024),
                                           ("prefill_first", 1024), ("fastdllm", 1024),
                                           ("adaptive", 64)])
def test_batch_invariance_matches_reference(loaded, arch, policy, budget):
    lm = loaded[arch]
    reqs = _workload(18, seed=7 if arch == "llada" else 8)
    cfg = EngineConfig(model=lm.path, device="cpu", dtype="float64", policy=policy,
                       token_budget=budget, page_size=4, num_pages=400)
    got = _run_staggered(Engine(cfg, lm), reqs, seed=3)
    _assert_same(got, _reference(lm, reqs))


# (refresh_interval, prompt_refresh_interval): every block fully; every 2nd block; every
# block, every 2nd fully (the others response-only); every 3rd, every 2nd of those fully;
# block 0 only.
CADENCES = [(1, 1), (2, 1), (1, 2), (3, 2), (1000, 1)]


def _cadence_workload(n: int, seed: int):
    """``_workload``'s requests, with a cache and a refresh cadence each, a third adaptive."""
    rng = random.Random(seed)
    return [(rid, prompt, dataclasses.replace(
                params, cache=rng.choice(["dual", "prefix"]), max_tokens=rng.choice([16, 24]),
                block_length=4, refresh_interval=ri, prompt_refresh_interval=pi,
                refresh_confidence=rng.choice([0.0, 0.0, 0.4])),  # 0.4: about half fire
             arrival, suffix)
            for (rid, prompt, params, arrival, suffix), (ri, pi)
            in zip(_workload(n, seed), (rng.choice(CADENCES) for _ in range(n)))]


@pytest.mark.parametrize("arch", ["llada", "dream"])
@pytest.mark.parametrize("policy,budget", [("deficit", 64), ("deficit", 1024),
                                           ("prefill_first", 1024), ("fastdllm", 1024)])
def test_refresh_cadence_matches_reference(loaded, arch, policy, budget):
    lm = loaded[arch]
    reqs = _cadence_workload(16, seed=30 if arch == "llada" else 31)
    cfg = EngineConfig(model=lm.path, device="cpu", dtype="float64", policy=policy,
                       token_budget=budget, page_size=4, num_pages=400)
    engine = Engine(cfg, lm)
    got = _run_staggered(engine, reqs, seed=5)
    _assert_same(got, _reference(lm, reqs))
    # The scheduler charged each refresh its span: T for a full one, T - P response-only (the
    # reference's spans, step by step).
    spans = {"full": 0, "response": 0, "forced": 0}
    for _, prompt, params, _, suffix in reqs:
        st = new_state(lm, prompt, params, random.Random(0), suffix)
        plan = st.plan

        def recording_plan(st=st, plan=plan, params=params):
            c = st.cursor
            start, end = c.span()
            if c.step == 0 and end == c.total_len and start in (0, c.prompt_len):
                kind = "full" if start == 0 else "response"
                spans[kind] += end - start
                spans["forced"] += st.cursor.block_refresh(st.cursor.block) != kind
            return plan()

        st.plan = recording_plan
        ReferenceDecoder(lm.model).run(st)
    assert sum(i.prefill_tokens for i in engine.stats.iterations) == (
        spans["full"] + spans["response"])
    assert spans["response"] > 0 and spans["forced"] > 0


def test_refresh_cadence_changes_tokens_and_forwards(loaded):
    """Each cadence is a different approximation: a policy the engine ignored would fail."""
    lm = loaded["llada"]
    base = SamplingParams(max_tokens=24, block_length=4, unmasking="topk", tokens_per_step=1,
                          stop_at_eos=False, logprobs=0)
    prompts = [[random.Random(i).randrange(2, 150) for _ in range(9)] for i in range(6)]
    outs = {}
    for ri, pi in CADENCES:
        params = dataclasses.replace(base, refresh_interval=ri, prompt_refresh_interval=pi)
        outs[ri, pi] = [_decode_one_by_one(lm, [(f"r{i}", p, params, None, [])])[f"r{i}"][2]
                        for i, p in enumerate(prompts)]  # the committed tokens' logprobs
    for cadence in CADENCES[1:]:  # a random model's argmax moves rarely: its confidence does
        assert all(a != b for a, b in zip(outs[cadence], outs[1, 1])), cadence
    # Spans of the first step of each block, for one request of 9 prompt tokens, T = 33.
    st = new_state(lm, prompts[0], dataclasses.replace(base, refresh_interval=3,
                                                      prompt_refresh_interval=2),
                      random.Random(0))
    firsts = []
    while not st.finished:
        if st.cursor.step == 0:
            firsts.append(st.cursor.span())
        plan = st.plan()
        st.apply(plan, np.full(len(plan.positions), 5), np.ones(len(plan.positions)))
    assert firsts == [(0, 33), (13, 17), (17, 21), (9, 33), (25, 29), (29, 33)]
    st = new_state(lm, prompts[0], dataclasses.replace(base, refresh_interval=2),
                      random.Random(0))
    st.cursor.block, st.cursor.force_refresh = 1, True  # taken back after a failure: a full refresh
    assert st.cursor.span() == (0, 33) and st.cursor.force_refresh
    plan = st.plan()
    st.apply(plan, np.full(len(plan.positions), 5), np.ones(len(plan.positions)))
    assert not st.cursor.force_refresh


def test_load_adaptive_threshold_lowers_toward_its_floor_under_load(loaded):
    """min_threshold, opt-in: alone, a request keeps its threshold (and the reference's
    tokens); among many, each block's threshold falls toward the floor with the worker's load,
    and every response says which it used."""
    lm = loaded["llada"]
    params = SamplingParams(max_tokens=16, block_length=4, threshold=0.9, min_threshold=0.3,
                            stop_at_eos=False)
    prompts = [[random.Random(i).randrange(2, 150) for _ in range(7)] for i in range(40)]
    cfg = EngineConfig(model=lm.path, device="cpu", dtype="float64", page_size=4,
                       num_pages=400, max_batch_size=16)
    alone = Engine(cfg, lm)
    got = _run_staggered(alone, [("a", prompts[0], params, None, [])], seed=0)
    ref = _decode_one_by_one(lm, [("a", prompts[0], params, None, [])])
    assert got["a"][:2] == ref["a"][:2]
    busy = Engine(cfg, lm)
    for i, p in enumerate(prompts):
        busy.add_request(f"r{i}", p, params)
    thresholds = {}
    while busy.has_unfinished_requests():
        for out in busy.step():
            if out.finished:
                thresholds[out.request_id] = out.block_thresholds
    assert all(len(t) == 4 and all(0.3 <= x <= 0.9 for x in t) for t in thresholds.values())
    assert min(min(t) for t in thresholds.values()) < 0.4  # a full worker: near the floor
    assert max(max(t) for t in thresholds.values()) > 0.8  # the last ones, alone again
    # Off: no thresholds reported; the fields' checks.
    off = Engine(cfg, lm)
    off.add_request("b", prompts[1], SamplingParams(max_tokens=8, block_length=4))
    outs = [o for _ in range(20) for o in off.step()]
    assert outs and all(o.block_thresholds is None for o in outs)
    with pytest.raises(ValueError, match="min_threshold"):
        SamplingParams(threshold=0.5, min_threshold=0.6)
    with pytest.raises(ValueError, match="min_threshold"):
        SamplingParams(unmasking="topk", min_threshold=0.5)
    assert SamplingParams(min_threshold=0.5).threshold_under(0.5) == pytest.approx(0.7)


def test_refresh_intervals_are_validated():
    with pytest.raises(ValueError, match="refresh_interval"):
        SamplingParams(refresh_interval=0)
    with pytest.raises(ValueError, match="prompt_refresh_interval"):
        SamplingParams(prompt_refresh_interval=2**31)
    with pytest.raises(ValueError, match="need a cache"):
        SamplingParams(cache="none", refresh_interval=2)


def test_batches_are_actually_mixed(loaded):
    lm = loaded["llada"]
    engine = Engine(EngineConfig(model=lm.path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=400), lm)
    for req in _workload(12, seed=1):
        engine.add_request(*req)
    while engine.has_unfinished_requests():
        engine.step()
    its = list(engine.stats.iterations)
    assert max(i.batch_size for i in its) > 4
    assert any(i.num_prefills and i.batch_size > i.num_prefills for i in its)  # mixed iteration


def test_no_page_leaks_with_aborts(loaded):
    lm = loaded["dream"]
    engine = Engine(EngineConfig(model=lm.path, device="cpu", dtype="float32", page_size=4,
                                 num_pages=120), lm)
    rng = random.Random(5)
    reqs = _workload(200, seed=11)
    live = []
    while reqs or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if reqs:
                req = reqs.pop()
                engine.add_request(*req)
                live.append(req[0])
        if live and rng.random() < 0.3:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    assert engine.pool.allocator.num_free == engine.pool.num_pages


@pytest.mark.parametrize("impl", ["python", "cext"])
def test_a_request_whose_commit_fails_ends_alone(loaded, impl):
    """A commit that fails (here: a canvas the step cannot write) ends its request with an
    error and frees its pages; the requests batched with it commit in the same forward and
    finish with the tokens they have alone, in both host paths."""
    from sangam.engine.host_batch import cext_available, make_host_batcher

    if impl == "cext" and not cext_available():
        pytest.skip("the C++ extension is not built")
    lm = loaded["llada"]
    engine = Engine(EngineConfig(model=lm.path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=120), lm)
    engine.runner.host = make_host_batcher(4, impl)
    reqs = _workload(3, seed=3, caches=("dual",))
    for req in reqs:
        engine.add_request(*req)
    engine.step()  # the refreshes: every request is seated now
    engine.requests[reqs[1][0]].state.tokens.flags.writeable = False
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    failed = outs[reqs[1][0]]
    assert failed.finish_reason == "error" and "failed in the engine" in failed.error
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    for req in (reqs[0], reqs[2]):
        alone = _reference(lm, [req])[req[0]]
        assert outs[req[0]].token_ids == alone[0] and outs[req[0]].finish_reason != "error"


def test_rejections_change_nothing(loaded):
    lm = loaded["llada"]
    engine = Engine(EngineConfig(model=lm.path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=8, max_queue_len=2), lm)
    with pytest.raises(RequestRejected, match="more than the pool's 8"):
        engine.add_request("big", [3] * 30, SamplingParams(max_tokens=8, block_length=8))
    engine.add_request("a", [3], SamplingParams(max_tokens=8, block_length=8))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [3], SamplingParams(max_tokens=8, block_length=8))
    engine.add_request("b", [3], SamplingParams(max_tokens=8, block_length=8))
    with pytest.raises(QueueFull):
        engine.add_request("c", [3], SamplingParams(max_tokens=8, block_length=8))
    assert set(engine.requests) == {"a", "b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.allocator.num_free == 8


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_padded_decode_batches_match_reference(loaded, arch):
    # The CUDA-graph path's padding and static buffers, run eagerly on CPU: batches of 8-token
    # DualCache steps are padded to buckets 1, 2, 4, 6 and must still give the reference tokens.
    lm = loaded[arch]
    reqs = _workload(18, seed=21, block_lengths=(8,), caches=("dual",))
    cfg = EngineConfig(model=lm.path, device="cpu", dtype="float64", page_size=4, num_pages=400,
                       max_batch_size=6)
    engine = Engine(cfg, lm)
    graphs = DecodeGraphRunner(lm.model, engine.pool.kv, span=8, max_batch_size=6,
                               max_pages=-(-lm.context_length // 4), device=lm.device,
                               use_graphs=False)
    engine.runner.graphs = [graphs]
    _assert_same(_run_staggered(engine, reqs, seed=4), _reference(lm, reqs))
    assert graphs.runs > 5, graphs.runs


def test_failed_graph_capture_falls_back_to_eager(loaded, monkeypatch, caplog):
    """A capture that fails (graphs have never run on this machine's GPU kind) leaves the
    engine eager, which computes the same tokens, with a warning that says why."""
    from sangam.engine import worker as engine_module

    tries = []

    def failing(*args, **kwargs):
        tries.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine_module, "DecodeGraphRunner", failing)
    lm = loaded["llada"]
    on_gpu = types.SimpleNamespace(  # what decode_graphs reads of a model loaded on a GPU
        model=types.SimpleNamespace(attention_backend=types.SimpleNamespace(name="triton")),
        device=torch.device("cuda"), context_length=lm.context_length,
        default_params=lm.default_params, config=lm.config)
    config = EngineConfig(model=lm.path, page_size=4, num_pages=8)
    pool = types.SimpleNamespace(kv=None, rings=None)
    with caplog.at_level("WARNING"):
        assert engine_module.decode_graphs(config, on_gpu, pool) == []
    assert "CUDA graph capture for block length" in caplog.text and "not permitted" in caplog.text
    assert len(tries) == 1
    eager = dataclasses.replace(config, enforce_eager=True)
    assert engine_module.decode_graphs(eager, on_gpu, pool) == [] and len(tries) == 1


def test_graphs_are_captured_for_the_block_lengths_requests_get(tiny_path, monkeypatch, caplog,
                                                                tmp_path):
    """The capture plan: the default block length requests get (the checkpoint's, or
    --block-length: ``serve --block-length 16`` replays graphs for its requests), or the
    --cuda-graph-block-lengths listed; logged."""
    from sangam.engine import worker as engine_module

    class Captured:
        def __init__(self, model, kv, span, *args, causal_block=None, **kwargs):
            self.span, self.causal_block = span, causal_block

    monkeypatch.setattr(engine_module, "DecodeGraphRunner", Captured)
    pool = types.SimpleNamespace(kv=None, rings=None)

    def plan(path: str = tiny_path, **options) -> list:
        config = EngineConfig(model=path, page_size=4, num_pages=8, **options)
        lm = LoadedModel.around(config, path, None, read_config(path), torch.device("cpu"),
                                torch.float32)
        on_gpu = types.SimpleNamespace(
            model=types.SimpleNamespace(attention_backend=types.SimpleNamespace(name="triton")),
            device=torch.device("cuda"), context_length=lm.context_length,
            default_params=lm.default_params, config=lm.config)
        return [g.span if g.causal_block is None else (g.causal_block, g.span)
                for g in engine_module.decode_graphs(config, on_gpu, pool)]

    with caplog.at_level("INFO"):
        assert plan() == [SamplingParams().block_length]  # no generation_config.json here
        assert plan(block_length=16) == [16]
        assert plan(block_length=16, cuda_graph_block_lengths="8,32") == [8, 32]
        # A block-causal model: each block length's later steps (B) and block starts (2B).
        sdar = make_tiny_checkpoint(tmp_path / "sdar", seed=1, arch="sdar")
        assert plan(sdar, block_length=4) == [(4, 4), (4, 8)]
        assert plan(sdar, cuda_graph_block_lengths="4,16") == [(4, 4), (4, 8), (16, 16),
                                                               (16, 32)]
    assert "CUDA graphs for decode steps of block length 8, 32" in caplog.text
    assert "block length 4 (span 4), 4 (span 8)" in caplog.text
    with pytest.raises(ValueError, match="cuda_graph_block_lengths"):
        EngineConfig(cuda_graph_block_lengths="8,x")


def _graphs_against_eager(path: str, prompts: list[list[int]], params_of, spans: list[int],
                          **options) -> None:
    """The same requests through an eager engine and one replaying CUDA graphs (captured for
    ``spans``): the graphs run, and the tokens are the same. ``params_of(llm)`` gives the
    requests' SamplingParams."""
    outs = {}
    for eager in (True, False):
        # An explicit pool: by default each LLM takes 90% of the GPU's free memory, and the
        # second is built while the first still holds its pool.
        llm = LLM(model=path, device="cuda", dtype="float64", enforce_eager=eager,
                  num_pages=512, **options)
        params = params_of(llm)
        graphs = llm.engine.runner.graphs
        assert [g.span for g in graphs] == ([] if eager else spans)
        outs[eager] = [(o.token_ids, o.num_forwards)
                       for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        if not eager:
            assert all(g.runs > 0 for g in graphs), [g.runs for g in graphs]
        llm.shutdown()
    assert outs[True] == outs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager(llada_path):
    params = SamplingParams(max_tokens=64, block_length=32, cache="dual",
                            unmasking="threshold", threshold=0.9)
    _graphs_against_eager(llada_path, [[3 + i] * (5 + 7 * i) for i in range(11)],
                          lambda llm: params, [32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_block_length_flag_replays_graphs(llada_path):
    """``serve --block-length 16``: requests that take the flag's block length replay the
    graphs captured for it, with the eager engine's tokens."""
    def params_of(llm):
        params = llm.loaded.default_params(max_tokens=48, cache="dual")  # as the server does
        assert params.block_length == 16
        return params

    _graphs_against_eager(llada_path, [[3 + i] * (5 + 7 * i) for i in range(6)], params_of,
                          [16], block_length=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_block_causal_graphs_match_eager(tmp_path):
    """SDAR's decode steps replay both runners (later steps, and block starts mixed with later
    steps, padded), with the eager engine's tokens."""
    path = make_tiny_checkpoint(tmp_path / "sdar", seed=5, arch="sdar", num_heads=8,
                                num_kv_heads=2, logit_scale=2.0)
    params = SamplingParams(max_tokens=48, block_length=4, threshold=0.6, stop_at_eos=False)
    _graphs_against_eager(path, [[3 + i] * (5 + 7 * i) for i in range(11)],
                          lambda llm: params, [4, 8], block_length=4)
