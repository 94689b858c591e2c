"""Block-causal diffusion models (SDAR): checkpoint layout, the mask, and the engine against the
upstream generate loop (README "Block-causal models")."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import httpx
import numpy as np
import pytest
import torch
from test_engine import staggered_outputs

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.reference_decoder import ReferenceDecoder, UpstreamBlockDiffusion, fused_savings
from sangam.engine.validation import new_state
from sangam.models import CheckpointError, load_model, parse_config, read_config
from sangam.testing import make_tiny_checkpoint, tiny_config

# GQA (4 query heads per K/V head), head_dim 32 given explicitly (hidden / heads would be 16);
# a small logit scale, so that blocks take several steps.
SDAR = dict(arch="sdar", num_heads=8, num_kv_heads=2, logit_scale=2.0)


@pytest.fixture(scope="module")
def sdar_path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sdar"), seed=5, **SDAR)


@pytest.fixture(scope="module")
def loaded(sdar_path) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=sdar_path, device="cpu", dtype="float64"))


# Checkpoint and config.
def test_config_reads_qwen3_names_and_sdar_defaults(tmp_path):
    cfg = parse_config(tiny_config("sdar", hidden_size=64, num_heads=4))
    assert (cfg.head_dim, cfg.qk_norm, cfg.block_causal, cfg.causal_block_size) == (32, True,
                                                                                   True, 4)
    raw = tiny_config("sdar")
    for key in ("mask_token_id", "eos_token_id", "block_size"):
        del raw[key]
    raw["vocab_size"] = 151936
    cfg = parse_config(raw)
    # The hub configs name neither token: SDAR's own <|MASK|> and <|im_end|>; blocks of 4.
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.causal_block_size) == (151669, 151645, 4)
    assert parse_config(raw, "/models/SDAR-8B-Chat-b32").causal_block_size == 32
    named = {**raw, "_name_or_path": "JetLM/SDAR-4B-Chat-b16"}
    assert parse_config(named).causal_block_size == 16
    assert not parse_config(tiny_config("dream")).block_causal
    with pytest.raises(CheckpointError, match="head_dim"):
        parse_config({**raw, "head_dim": -8})


def test_tied_head_loads_without_lm_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "SDAR-tiny-b8", seed=1, arch="sdar",
                                tie_word_embeddings=True)
    raw = json.loads((tmp_path / "SDAR-tiny-b8" / "config.json").read_text())
    del raw["block_size"]  # the -b8 suffix of the directory says it
    (tmp_path / "SDAR-tiny-b8" / "config.json").write_text(json.dumps(raw))
    model = load_model(path)
    assert "lm_head.weight" not in model.state_dict()
    assert read_config(path).causal_block_size == 8
    assert model.output_head() is model.model.embed_tokens


def test_dense_forward_is_block_causal(sdar_path):
    """A query sees its own block and the blocks before: changing a later block moves no
    earlier logit; changing a token of the same block does."""
    model = load_model(sdar_path, dtype="float64")
    ids = torch.randint(2, 150, (1, 12), generator=torch.Generator().manual_seed(0))
    base = model.forward_dense(ids)
    later = ids.clone()
    later[0, 8:] = 7  # block 2 (of 4)
    same = ids.clone()
    same[0, 5] = 9  # block 1
    assert torch.equal(model.forward_dense(later)[0, :8], base[0, :8])
    moved = model.forward_dense(same)[0]
    assert torch.equal(moved[:4], base[0, :4]) and not torch.allclose(moved[4:8], base[0, 4:8])
    assert not torch.allclose(model.forward_dense(later, block_size=12)[0, :8], base[0, :8])


# Decoding semantics.
def _request(rng, i):
    b = rng.choice([2, 4, 8])
    return (f"r{i}", [rng.randrange(2, 150) for _ in range(rng.randrange(1, 30))],
            SamplingParams(max_tokens=rng.randrange(1, 20), block_length=b,
                           threshold=rng.choice([0.3, 0.6, 0.9]),
                           temperature=rng.choice([0.0, 0.0, 1.0]), seed=i,
                           stop_at_eos=rng.random() < 0.5))


def _upstream(loaded, reqs):
    """Tokens and upstream forwards per request, and the forwards the engine should spend."""
    out = {}
    for rid, prompt, params in reqs:
        st = new_state(loaded, prompt, params, random.Random(0))
        tokens, forwards = UpstreamBlockDiffusion(loaded.model).run(st)
        out[rid] = (tokens, forwards - fused_savings(st))
    return out


def test_canvas_lies_on_the_block_grid(loaded):
    params = SamplingParams(max_tokens=6, block_length=4, stop_at_eos=False)
    st = new_state(loaded, [5] * 7, params, random.Random(0))
    # T = ceil((7 + 6) / 4) * 4 = 16; block 0 = [4, 8) holds the prompt's tail 4..6.
    c = st.cursor
    assert (c.total_len, c.block_origin, c.num_blocks, c.block_bounds()) == (16, 4, 3, (4, 8))
    assert st.cursor.span() == (0, 8)  # the prompt's K/V and block 0's first step in one forward
    st.commit(st.plan().positions, 0, np.array([9]), np.array([1.0]))  # 7: block 0 is done
    assert st.cursor.block == 1 and st.cursor.span() == (4, 12)  # stores block 0, steps block 1
    assert st.plan().rows.tolist() == [4, 5, 6, 7]  # unshifted: row p predicts position p
    ReferenceDecoder(loaded.model).run(st)
    assert st.finished and len(st.output_token_ids()) == 6
    with pytest.raises(ValueError, match="block-causal"):
        new_state(loaded, [5], SamplingParams(cache="prefix"), random.Random(0))
    with pytest.raises(ValueError, match="refresh_interval"):
        new_state(loaded, [5], SamplingParams(refresh_interval=2), random.Random(0))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompt", "chunked"])
@pytest.mark.parametrize("tau", [64, 1024, float("inf")])
def test_engine_equals_the_upstream_loop_under_batching(sdar_path, loaded, tau, chunked):
    """Mixed prompt lengths (some below one block, some on the grid, some over tau), block
    sizes 2-8, thresholds, greedy and sampled, stop at EOS or not, arriving while others run:
    every request's tokens are the upstream loop's, in float64, and its forwards are upstream's
    less the fused store forwards, plus its prefill chunks when the prompt was admitted in
    parts (each a later admission: ``num_refreshes`` - 1)."""
    rng = random.Random(3)
    reqs = [_request(rng, i) for i in range(14)]
    reqs += [(f"long{i}", [rng.randrange(2, 150) for _ in range(rng.randrange(70, 150))],
              SamplingParams(max_tokens=8, block_length=4, threshold=0.6, seed=i))
             for i in range(3)]
    want = _upstream(loaded, reqs)
    engine = Engine(EngineConfig(model=sdar_path, device="cpu", dtype="float64",
                                 token_budget=tau, page_size=4, num_pages=400,
                                 enable_chunked_prefill=chunked), loaded)
    outs = staggered_outputs(engine, reqs, rng)
    chunks = {rid: o.metrics["num_refreshes"] - 1 for rid, o in outs.items()}
    got = {rid: (o.token_ids, o.num_forwards - chunks[rid]) for rid, o in outs.items()}
    assert got == want
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    assert any(len(set(t)) > 2 for t, _ in want.values())  # the tokens are not degenerate
    # Chunks happen only when asked for, under a budget that long prompts exceed.
    assert (max(chunks.values()) > 0) == (chunked and tau == 64)


def test_llm_and_async_engine_serve_sdar(sdar_path, loaded):
    rng = random.Random(8)
    reqs = [_request(rng, i) for i in range(6)]
    want = _upstream(loaded, reqs)
    llm = LLM(sdar_path, device="cpu", dtype="float64")
    outs = llm.generate(prompt_token_ids=[p for _, p, _ in reqs],
                        sampling_params=[s for _, _, s in reqs])
    assert [(o.token_ids, o.num_forwards) for o in outs] == [want[r] for r, _, _ in reqs]
    assert llm.get_default_sampling_params().block_length == 4  # the trained block size
    engine = AsyncEngine(EngineConfig(model=sdar_path, device="cpu", dtype="float64"))

    async def collect(rid, prompt, params):
        return [o async for o in engine.generate(prompt, params, rid)]

    async def main():
        return await asyncio.gather(*(collect(*r) for r in reqs))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for (rid, _, _), outs in zip(reqs, streams):
        assert (outs[-1].token_ids, outs[-1].num_forwards) == want[rid]
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(lengths) and outs[-1].finished


def test_colocated_workers_equal_the_upstream_loop(sdar_path, loaded):
    """Worker processes serve it colocated, each request on one worker for all its blocks
    (chunked prefill included)."""
    rng = random.Random(4)
    reqs = [_request(rng, i) for i in range(8)]
    reqs += [("long", [rng.randrange(2, 150) for _ in range(90)],
              SamplingParams(max_tokens=8, block_length=4, threshold=0.6, seed=1))]
    want = _upstream(loaded, reqs)
    llm = LLM(sdar_path, device="cpu", dtype="float64", num_workers=2, page_size=4,
              num_pages=200, token_budget=64, enable_chunked_prefill=True)
    try:
        outs = llm.generate(prompt_token_ids=[p for _, p, _ in reqs],
                            sampling_params=[s for _, _, s in reqs])
        got = [(o.token_ids, o.num_forwards - (o.metrics["num_refreshes"] - 1)) for o in outs]
        assert got == [want[r] for r, _, _ in reqs]
        assert max(o.metrics["num_refreshes"] for o in outs) > 1  # the long prompt in chunks
        assert len(llm.engine.placement.counters.prefills_by_worker) == 2  # both served
    finally:
        llm.shutdown()


def test_graph_runners_padded_batches_equal_the_upstream_loop(sdar_path, loaded):
    """The CUDA-graph path of block-causal decode steps, run eagerly on CPU: batches of later
    steps (span B) and batches mixing block starts (2B) with later steps (B, padded to 2B)
    replay through the runners' static buffers and still give the upstream tokens."""
    from sangam.engine.cuda_graphs import DecodeGraphRunner

    rng = random.Random(9)
    reqs = [(f"g{i}", [rng.randrange(2, 150) for _ in range(rng.randrange(1, 30))],
             SamplingParams(max_tokens=rng.randrange(4, 24), block_length=4,
                            threshold=rng.choice([0.3, 0.6, 0.9]), seed=i, stop_at_eos=False))
            for i in range(12)]
    want = _upstream(loaded, reqs)
    engine = Engine(EngineConfig(model=sdar_path, device="cpu", dtype="float64", page_size=4,
                                 num_pages=300, max_batch_size=6), loaded)
    runners = [DecodeGraphRunner(loaded.model, engine.pool.kv, span, 6,
                                 -(-loaded.context_length // 4), loaded.device,
                                 use_graphs=False, causal_block=4) for span in (4, 8)]
    engine.runner.graphs = runners
    done, pending = {}, list(reqs)
    while pending or engine.has_unfinished_requests():
        for rid, prompt, params in pending[:2]:  # staggered: blocks start at different steps
            engine.add_request(rid, prompt, params)
        pending = pending[2:]
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert {r: (o.token_ids, o.num_forwards) for r, o in done.items()} == want
    assert all(r.runs > 3 for r in runners), [r.runs for r in runners]


# Disaggregated and hybrid: the prompt's prefill (with block 0's first step) on a prefill
# worker, its K/V sent once, every block step on the decode worker.
BLOCK_CAUSAL_LAYOUTS = {
    "1P2D": dict(mode="disaggregated", prefill_workers=1, decode_workers=2),
    "2P1D-streaming": dict(mode="disaggregated", prefill_workers=2, decode_workers=1,
                           layerwise_kv_streaming=True),
    "hybrid-1P2C": dict(mode="hybrid", prefill_workers=1, decode_workers=2,
                        overflow_threshold=8),
}


def run_in_mode(path: str, reqs: list, layout: dict, kill: int | None = None) -> dict:
    """Serve ``reqs`` on worker processes laid out as ``layout`` (chunked prefill under a
    small budget), SIGKILLing worker ``kill`` at the fifth output; the outputs by id, and the
    dead workers."""
    import os
    import signal

    llm = LLM(path, device="cpu", dtype="float64", page_size=4, num_pages=200, token_budget=64,
              enable_chunked_prefill=True, watchdog_timeout=3.0, **layout)
    engine = llm.engine
    try:
        for rid, prompt, params in reqs:
            engine.add_request(rid, prompt, params)
        done, seen = {}, 0
        while len(done) < len(reqs):
            for out in engine.step():
                seen += 1
                if seen == 5 and kill is not None:
                    os.kill(engine.worker_states()[kill].pid, signal.SIGKILL)
                if out.finished:
                    done[out.request_id] = out
        return {"outs": done, "dead": engine.dead_workers}
    finally:
        llm.shutdown()


def check_modes(path: str, reqs: list, want: dict, layout: dict, kill: int | None) -> None:
    """Every request ends with the upstream loop's tokens; untouched by failures, with its
    forwards too (a chunked prefill's chunks aside) and its K/V sent at most once. Whether a
    prefill is chunked depends on what its worker runs meanwhile, which worker processes'
    timing decides: chunking itself is tested colocated."""
    run = run_in_mode(path, reqs, layout, kill)
    outs = run["outs"]
    assert {r: o.token_ids for r, o in outs.items()} == {r: w[0] for r, w in want.items()}
    assert all(o.finish_reason in ("stop", "length") for o in outs.values())
    if kill is None:
        assert run["dead"] == []
        assert {r: o.num_forwards - (o.metrics["num_refreshes"] - 1)
                for r, o in outs.items()} == {r: w[1] for r, w in want.items()}
        assert max(o.metrics["kv_transfers"] for o in outs.values()) == 1
    else:
        assert run["dead"] == [kill]


# (layout, the worker killed mid-run): each layout healthy, and one kill of each role.
MODE_CASES = [(layout, None) for layout in BLOCK_CAUSAL_LAYOUTS] + [
    ("1P2D", 2), ("2P1D-streaming", 0), ("hybrid-1P2C", 1)]


@pytest.fixture(scope="module")
def mode_workload(loaded):
    rng = random.Random(4)
    reqs = [_request(rng, i) for i in range(14)]
    reqs += [(f"long{i}", [rng.randrange(2, 150) for _ in range(70 + 10 * i)],
              SamplingParams(max_tokens=12, block_length=4, threshold=0.6, seed=i))
             for i in range(2)]
    return reqs, _upstream(loaded, reqs)


@pytest.mark.parametrize("layout,kill", MODE_CASES)
def test_disaggregated_and_hybrid_equal_the_upstream_loop(sdar_path, mode_workload, layout,
                                                          kill):
    check_modes(sdar_path, *mode_workload, BLOCK_CAUSAL_LAYOUTS[layout], kill)


def test_server_serves_sdar(tmp_path):
    from tests.test_serve_openai import serve_subprocess

    path = make_tiny_checkpoint(tmp_path / "sdar_tok", seed=6, vocab_size=VOCAB_SIZE, **SDAR)
    write_tokenizer(path)
    llm = LLM(path, device="cpu", dtype="float64")
    # The server's requests take the model's defaults: blocks of its trained size.
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=10,
                                 stop_at_eos=False)
    want = llm.generate(["hello"], params)[0]
    args = ["--model", path, "--device", "cpu", "--dtype", "float64", "--served-model-name",
            "sdar"]
    with serve_subprocess(args, tmp_path / "server.log") as (_, base):
        body = {"model": "sdar", "prompt": "hello", "max_tokens": 10, "stop_at_eos": False}
        res = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert res["choices"][0]["token_ids"] == want.token_ids
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "sdar", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8}).json()
        assert chat["choices"][0]["finish_reason"] in ("stop", "length")
        bad = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={**body, "cache": "prefix"})
        assert bad.status_code == 400 and "block-causal" in bad.text


def test_real_shapes_and_stop_ids():
    """--load-format dummy configs of the SDAR shapes parse to the cost model's geometry, and
    a Qwen tokenizer's <|im_end|> and <|endoftext|> both stop a response."""
    from sangam.bench.cost_model import MODELS
    from sangam.models import stop_token_ids
    from sangam.testing import real_shape_config

    for key in ("sdar", "sdar-4b", "sdar-1.7b"):
        cfg, g = parse_config(real_shape_config(key)), MODELS[key]
        assert (cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings) == (
            g.head_dim, g.kv_heads, g.tied_head)
        assert cfg.block_causal and cfg.head_dim == 128

    class QwenVocab:
        eos_token_id = None

        @staticmethod
        def get_vocab():
            return {"<|im_end|>": 151645, "<|endoftext|>": 151643, "hi": 5}

    assert stop_token_ids(151645, QwenVocab()) == {151645, 151643}


def test_abort_between_prefill_chunks_frees_its_pages(sdar_path, loaded):
    """A request aborted while its prompt is half prefilled (waiting, pages held, between
    chunks) or decoding frees everything; the others are untouched and exact."""
    rng = random.Random(11)
    reqs = [(f"long{i}", [rng.randrange(2, 150) for _ in range(120)],
             SamplingParams(max_tokens=8, block_length=4, threshold=0.6, seed=i))
            for i in range(3)] + [_request(rng, i) for i in range(6)]
    want = _upstream(loaded, reqs)
    engine = Engine(EngineConfig(model=sdar_path, device="cpu", dtype="float64",
                                 token_budget=64, page_size=4, num_pages=400,
                                 enable_chunked_prefill=True), loaded)
    for r in reqs:
        engine.add_request(*r)
    got, aborted = {}, set()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.token_ids
        for rid, t in list(engine.requests.items()):
            c = t.state.cursor
            mid_chunk = 0 < c.prefilled < c.block_origin and c.block == 0
            decoding = rid.startswith("r") and t.state.cursor.block == 1
            if (mid_chunk and rid == "long1") or (decoding and len(aborted) == 1):
                assert engine.abort_request(rid).finish_reason == "abort"
                aborted.add(rid)
    assert "long1" in aborted and len(aborted) == 2
    assert got == {rid: want[rid][0] for rid in want if rid not in aborted}
    assert engine.pool.allocator.num_free == engine.pool.num_pages
