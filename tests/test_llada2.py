"""LLaDA2.x (``LLaDA2MoeModelLM``): the checkpoint layout, the forward against a dense reference
written from the upstream semantics, and the engine against the upstream generate loop, with
and without LLaDA2.1's token editing (README "Architectures", docs/decoding.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from test_engine import staggered_outputs
from test_sdar import BLOCK_CAUSAL_LAYOUTS, check_modes

from sangam import LLM, SamplingParams
from sangam.config import EngineConfig
from sangam.demo.tokenizer import VOCAB_SIZE, write_tokenizer
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.reference_decoder import ReferenceDecoder, UpstreamLLaDA2
from sangam.engine.validation import new_state
from sangam.models import (
    AttentionMetadata,
    CheckpointError,
    PagedKV,
    TorchAttentionBackend,
    load_model,
    parse_config,
)
from sangam.testing import make_tiny_checkpoint, tiny_config

# Three layers (a dense one, then two MoE), GQA 4:2, head_dim 16 with 8 rotary dims; 8 experts
# in 4 groups (2 kept), top 2, a shared expert; a small logit scale so that blocks take steps.
LLADA2 = dict(arch="llada2", num_layers=3, num_heads=4, num_kv_heads=2, logit_scale=2.0,
              block_size=8)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), seed=11, **LLADA2)


@pytest.fixture(scope="module")
def loaded(path) -> LoadedModel:
    return LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))


# Checkpoint and config.
def test_config_reads_the_upstream_keys():
    raw = tiny_config("llada2")
    for key in ("mask_token_id", "eos_token_id", "rope_theta"):
        del raw[key]
    raw["vocab_size"] = 157184
    cfg = parse_config(raw)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.rope_theta) == (156895, 156892, 600000.0)
    assert (cfg.block_causal, cfg.causal_block_size, cfg.qk_norm) == (True, 32, True)
    assert (cfg.head_dim, cfg.rotary_dim) == (16, 8)  # partial_rotary_factor 0.5
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.score, m.scale) == (
        8, 2, 4, 2, "sigmoid", 2.5)
    assert (m.shared_intermediate_size, m.first_dense_layers, m.expert_bias) == (32, 1, True)
    # Keys the upstream code never reads change nothing.
    assert parse_config({**raw, "norm_topk_prob": False, "rotary_dim": 4}) == cfg
    with pytest.raises(CheckpointError, match="groups"):
        parse_config({**raw, "n_group": 3})
    with pytest.raises(CheckpointError, match="topk_group"):
        parse_config({**raw, "topk_group": 1, "num_experts_per_tok": 3})


def test_checkpoint_has_the_real_tensor_names(path):
    model = load_model(path, dtype="float64")
    names = set(model.state_dict())
    for name in ("model.word_embeddings.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.0.attention.query_key_value.weight",
                 "model.layers.1.attention.query_layernorm.weight",
                 "model.layers.1.attention.key_layernorm.weight",
                 "model.layers.1.attention.dense.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.expert_bias",
                 "model.layers.2.mlp.experts.7.down_proj.weight",
                 "model.layers.2.mlp.shared_experts.up_proj.weight",
                 "model.norm.weight", "lm_head.weight"):
        assert name in names, name
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in names)
    # The experts are stacked once, in place: their weights are views of the stacked tensors.
    moe = model.model.layers[1].mlp
    w13, w2, _ = moe.stacked()
    assert moe.experts[3].up_proj.weight.data_ptr() == w13[3, 32:].data_ptr()
    assert moe.stacked()[0] is w13


def test_bf16_load_keeps_the_expert_bias_in_fp32(path):
    model = load_model(path, dtype="bfloat16")
    assert model.model.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16


# The forward against a dense reference written from the upstream semantics.
def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_half(x, pos, theta, rd):
    """NeoX rotate-half RoPE on the first rd dims of each head; the rest pass unchanged."""
    inv = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    r, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos + rot * sin, rest], -1)


def _route(x, gate_w, bias, n_group, topk_group, top_k, scale):
    """Per token, in plain Python: sigmoid scores, groups ranked by the sum of their best two
    biased scores, the best topk_group groups eligible, top_k experts by biased score; combine
    weights are the unbiased scores renormalised, times scale."""
    s = torch.sigmoid(x @ gate_w.T)
    choice = []
    for t in range(s.shape[0]):
        biased = (s[t] + bias).tolist()
        per = len(biased) // n_group
        groups = sorted(range(n_group), key=lambda g: -sum(sorted(
            biased[g * per:(g + 1) * per], reverse=True)[:2]))[:topk_group]
        eligible = [e for g in groups for e in range(g * per, (g + 1) * per)]
        experts = sorted(eligible, key=lambda e: -biased[e])[:top_k]
        w = s[t, experts]
        choice.append((experts, w / w.sum() * scale))
    return choice


def _swiglu(x, prefix, sd):
    return F.silu(x @ sd[f"{prefix}.gate_proj.weight"].T) * (
        x @ sd[f"{prefix}.up_proj.weight"].T) @ sd[f"{prefix}.down_proj.weight"].T


def _dense_reference(sd, raw, ids, block):
    H, KV = raw["num_attention_heads"], raw["num_key_value_heads"]
    D, eps, theta = raw["head_dim"], raw["rms_norm_eps"], raw["rope_theta"]
    rd = int(D * raw["partial_rotary_factor"])
    T = len(ids)
    pos = torch.arange(T)
    blk = pos // block
    allowed = blk[None, :] <= blk[:, None]  # query i sees key j in its block or earlier
    h = sd["model.word_embeddings.weight"][ids]
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}"
        x = _rms(h, sd[f"{p}.input_layernorm.weight"], eps)
        qkv = x @ sd[f"{p}.attention.query_key_value.weight"].T
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + KV) * D].view(T, KV, D)
        v = qkv[:, (H + KV) * D:].view(T, KV, D)
        q = _rms(q, sd[f"{p}.attention.query_layernorm.weight"], eps)
        k = _rms(k, sd[f"{p}.attention.key_layernorm.weight"], eps)
        q, k = _rope_half(q, pos, theta, rd), _rope_half(k, pos, theta, rd)
        out = torch.empty(T, H, D, dtype=torch.float64)
        for head in range(H):
            kv = head // (H // KV)
            scores = (q[:, head] @ k[:, kv].T) / D ** 0.5
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[:, head] = scores.softmax(-1) @ v[:, kv]
        h = h + out.reshape(T, H * D) @ sd[f"{p}.attention.dense.weight"].T
        x = _rms(h, sd[f"{p}.post_attention_layernorm.weight"], eps)
        if i < raw["first_k_dense_replace"]:
            h = h + _swiglu(x, f"{p}.mlp", sd)
            continue
        y = _swiglu(x, f"{p}.mlp.shared_experts", sd)
        routes = _route(x, sd[f"{p}.mlp.gate.weight"], sd[f"{p}.mlp.gate.expert_bias"],
                        raw["n_group"], raw["topk_group"], raw["num_experts_per_tok"],
                        raw["routed_scaling_factor"])
        for t, (experts, weights) in enumerate(routes):
            for e, w in zip(experts, weights):
                y[t] = y[t] + w * _swiglu(x[t:t + 1], f"{p}.mlp.experts.{e}", sd)[0]
        h = h + y
    h = _rms(h, sd["model.norm.weight"], eps)
    return h @ sd["lm_head.weight"].T


def test_forward_equals_the_dense_reference(path):
    model = load_model(path, dtype="float64")
    raw = json.loads((Path(path) / "config.json").read_text())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor(random.Random(0).choices(range(150), k=21))
    for block in (8, 32):  # three blocks; one
        want = _dense_reference(sd, raw, ids, block)
        got = model.forward_dense(ids[None], block_size=block)[0]
        assert (got - want).abs().max().item() < 1e-10
    # The expert bias steers the routing (some choice differs without it).
    moe = model.model.layers[1].mlp
    x = torch.randn(64, raw["hidden_size"], dtype=torch.float64)
    with_bias = moe.route(x)[1]
    saved = moe.gate.expert_bias.clone()
    moe.gate.expert_bias.data.zero_()
    assert not torch.equal(moe.route(x)[1], with_bias)
    moe.gate.expert_bias.data.copy_(saved)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_forward_equals_the_dense_one(path, backend):
    """Two requests in one packed forward with the block-causal mask, their K/V in pages; with
    the Triton backend the experts run in the fused-MoE kernels too."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    from sangam.models.triton_attention import TritonAttentionBackend

    model = load_model(path, dtype="float64")
    model.attention_backend = (TritonAttentionBackend() if backend == "triton"
                               else TorchAttentionBackend())
    a, b = torch.arange(3, 22), torch.arange(30, 43)
    kv = PagedKV.allocate(3, 9, 4, 2, 16, torch.float64, "cpu")
    tables = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 0]], dtype=torch.int32)
    slots = torch.cat([torch.arange(19), 20 + torch.arange(13)])
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 19, 32], dtype=torch.int32),
        kv_lens=torch.tensor([19, 13], dtype=torch.int32), block_tables=tables,
        slot_mapping=slots, query_lens=[19, 13], kv_lens_host=[19, 13],
        causal_blocks=torch.tensor([8, 4], dtype=torch.int32),
        positions=torch.cat([torch.arange(19), torch.arange(13)]))
    got = model(torch.cat([a, b]), meta.positions, meta, kv, torch.arange(32))
    want_a = model.forward_dense(a[None], block_size=8)[0]
    want_b = model.forward_dense(b[None], block_size=4)[0]
    assert torch.allclose(got, torch.cat([want_a, want_b]), atol=1e-10, rtol=0)


# Decoding: the engine against the upstream loop.
def _request(rng, i, edit):
    return (f"r{i}", [rng.randrange(2, 150) for _ in range(rng.randrange(1, 30))],
            SamplingParams(max_tokens=rng.randrange(1, 24), block_length=8,
                           threshold=rng.choice([0.3, 0.6, 0.95]),
                           edit_threshold=rng.choice([0.0, 0.5, 0.9]) if edit else None,
                           max_post_steps=rng.choice([0, 1, 16]),
                           temperature=rng.choice([0.0, 0.0, 1.0]), seed=i,
                           stop_at_eos=rng.random() < 0.5))


def _upstream(loaded, reqs):
    """Per request: the upstream loop's tokens, and its forwards less those the engine fuses."""
    out = {}
    for rid, prompt, params in reqs:
        st = new_state(loaded, prompt, params, random.Random(0))
        tokens, forwards, fused = UpstreamLLaDA2(loaded.model).run(st)
        out[rid] = (tokens, forwards - fused)
    return out


def test_model_defaults_and_editing_bounds(loaded):
    assert loaded.default_params().block_length == 8  # the checkpoint's block_size
    assert loaded.default_params().threshold == 0.95  # LLaDA2's generate default
    with pytest.raises(ValueError, match="edit_threshold"):
        SamplingParams(edit_threshold=1.5)
    with pytest.raises(ValueError, match="max_post_steps"):
        SamplingParams(edit_threshold=0.5, max_post_steps=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(edit_threshold=0.5, logprobs=2)


def test_editing_changes_tokens_and_adds_steps(loaded):
    """Editing is live on this model: some request's tokens or step count differ with it."""
    rng = random.Random(5)
    changed = 0
    for i in range(12):
        rid, prompt, params = _request(rng, i, edit=True)
        off = dataclasses.replace(params, edit_threshold=None)
        a = UpstreamLLaDA2(loaded.model).run(new_state(loaded, prompt, params,
                                                       random.Random(0)))
        b = UpstreamLLaDA2(loaded.model).run(new_state(loaded, prompt, off, random.Random(0)))
        changed += a[:2] != b[:2]
    assert changed >= 3


@pytest.mark.parametrize("edit", [False, True], ids=["llada2.0", "llada2.1-editing"])
@pytest.mark.parametrize("tau", [64, 1024, float("inf")])
def test_engine_equals_the_upstream_loop_under_batching(path, loaded, tau, edit):
    """Mixed prompt lengths, thresholds, editing thresholds and post-step allowances, greedy
    and sampled, arriving while others run: every request's tokens are the upstream loop's,
    in float64, and its forwards upstream's less the fused store forwards (plus its prefill
    chunks: chunked prefill is on)."""
    rng = random.Random(3 + edit)
    reqs = [_request(rng, i, edit) for i in range(12)]
    reqs += [(f"long{i}", [rng.randrange(2, 150) for _ in range(rng.randrange(70, 120))],
              SamplingParams(max_tokens=10, block_length=8, threshold=0.6, seed=i,
                             edit_threshold=0.5 if edit else None))
             for i in range(2)]
    want = _upstream(loaded, reqs)
    engine = Engine(EngineConfig(model=path, device="cpu", dtype="float64", token_budget=tau,
                                 page_size=4, num_pages=400, enable_chunked_prefill=True),
                    loaded)
    got = {rid: (o.token_ids, o.num_forwards - (o.metrics["num_refreshes"] - 1))
           for rid, o in staggered_outputs(engine, reqs, rng).items()}
    assert got == want
    assert engine.pool.allocator.num_free == engine.pool.num_pages
    assert any(len(set(t)) > 2 for t, _ in want.values())  # the tokens are not degenerate


def test_reference_decoder_equals_the_upstream_loop(loaded):
    rng = random.Random(9)
    for i in range(8):
        rid, prompt, params = _request(rng, i, edit=i % 2 == 1)
        want = _upstream(loaded, [(rid, prompt, params)])[rid]
        st = ReferenceDecoder(loaded.model).run(new_state(loaded, prompt, params,
                                                          random.Random(0)))
        assert (st.output_token_ids(), st.num_forwards) == want


def test_llm_and_async_engine_serve_llada2(path, loaded):
    rng = random.Random(8)
    reqs = [_request(rng, i, edit=i % 2 == 0) for i in range(6)]
    want = _upstream(loaded, reqs)
    llm = LLM(path, device="cpu", dtype="float64")
    outs = llm.generate(prompt_token_ids=[p for _, p, _ in reqs],
                        sampling_params=[s for _, _, s in reqs])
    assert [(o.token_ids, o.num_forwards) for o in outs] == [want[r] for r, _, _ in reqs]
    engine = AsyncEngine(EngineConfig(model=path, device="cpu", dtype="float64"))

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


def test_server_serves_llada2_with_editing(tmp_path):
    from tests.test_serve_openai import serve_subprocess

    path = make_tiny_checkpoint(tmp_path / "llada2_tok", seed=12, vocab_size=VOCAB_SIZE,
                                **LLADA2)
    write_tokenizer(path)
    llm = LLM(path, device="cpu", dtype="float64")
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=12,
                                 stop_at_eos=False, edit_threshold=0.5, max_post_steps=4)
    want = llm.generate(["hello"], params)[0]
    args = ["--model", path, "--device", "cpu", "--dtype", "float64", "--served-model-name",
            "llada2"]
    with serve_subprocess(args, tmp_path / "server.log") as (_, base):
        body = {"model": "llada2", "prompt": "hello", "max_tokens": 12, "stop_at_eos": False,
                "edit_threshold": 0.5, "max_post_steps": 4}
        res = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert res["choices"][0]["token_ids"] == want.token_ids
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={**body, "stream": True}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 2  # streamed block by block
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "llada2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8}).json()
        assert chat["choices"][0]["finish_reason"] in ("stop", "length")
        bad = httpx.post(f"{base}/v1/completions", timeout=60,
                         json={**body, "edit_threshold": 2})
        assert bad.status_code == 400


def test_editing_needs_a_block_causal_model(tmp_path):
    llada = make_tiny_checkpoint(tmp_path / "llada", seed=1)
    lm = LoadedModel.load(EngineConfig(model=llada, device="cpu", dtype="float64"))
    with pytest.raises(ValueError, match="block-causal"):
        new_state(lm, [5, 6], SamplingParams(edit_threshold=0.5), random.Random(0))


def test_real_shapes_parse(tmp_path):
    from sangam import testing

    for key, layers in (("llada2-mini", 20), ("llada2-flash", 32)):
        assert testing.main([str(tmp_path / key), "--shape", key]) == 0
        cfg = parse_config(json.loads((tmp_path / key / "config.json").read_text()))
        assert (cfg.num_layers, cfg.moe.num_experts, cfg.moe.top_k, cfg.rotary_dim,
                cfg.moe.first_dense_layers, cfg.causal_block_size) == (layers, 256, 8, 64, 1, 32)


def test_colocated_workers_equal_the_upstream_loop(path, loaded):
    """Two worker processes, editing on and off, a long prompt admitted in chunks. A prompt is
    chunked only while its worker runs other work (else the idle rule admits it whole): the
    long one comes once both workers decode requests of three blocks or more."""
    rng = random.Random(4)
    reqs = [(r, p, dataclasses.replace(s, max_tokens=max(s.max_tokens, 17)))
            for r, p, s in (_request(rng, i, edit=i % 2 == 0) for i in range(6))]
    reqs += [("long", [rng.randrange(2, 150) for _ in range(90)],
              SamplingParams(max_tokens=10, block_length=8, threshold=0.6, seed=1,
                             edit_threshold=0.5))]
    want = _upstream(loaded, reqs)
    llm = LLM(path, device="cpu", dtype="float64", num_workers=2, page_size=4,
              num_pages=200, token_budget=64, enable_chunked_prefill=True)
    engine, outs = llm.engine, {}
    try:
        for rid, prompt, params in reqs[:-1]:
            engine.add_request(rid, prompt, params)
        while not outs:  # the first block is done somewhere: both workers are decoding
            outs.update((o.request_id, o) for o in engine.step())
        engine.add_request(*reqs[-1])
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o) for o in engine.step())
        got = {r: (o.token_ids, o.num_forwards - (o.metrics["num_refreshes"] - 1))
               for r, o in outs.items()}
        assert got == {r: want[r] for r, _, _ in reqs}
        assert outs["long"].metrics["num_refreshes"] > 1  # the long prompt in chunks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout,kill", [(layout, None) for layout in BLOCK_CAUSAL_LAYOUTS]
                         + [("hybrid-1P2C", 2)])
def test_disaggregated_and_hybrid_equal_the_upstream_loop(path, loaded, layout, kill):
    """The prefill on a prefill worker, its K/V sent once, block steps (editing included) on
    the decode worker; a worker killed mid-run loses nothing."""
    rng = random.Random(7)
    reqs = [_request(rng, i, edit=i % 2 == 0) for i in range(8)]
    reqs += [("long", [rng.randrange(2, 150) for _ in range(90)],
              SamplingParams(max_tokens=16, block_length=8, threshold=0.6, seed=1,
                             edit_threshold=0.5))]
    check_modes(path, reqs, _upstream(loaded, reqs), BLOCK_CAUSAL_LAYOUTS[layout], kill)
