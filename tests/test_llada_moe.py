"""LLaDA-MoE (``LLaDAMoEModelLM``, LLaDA-MoE-7B-A1B): the config's keys and defaults, the
forward against a dense reference written here from the upstream modeling code's semantics,
the paged forward, and the batched engine against the one-request reference decoder in every
cache mode."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from test_engine import _assert_same, _decode_one_by_one, _run_staggered
from test_models import _forward, _kv

from sangam.config import EngineConfig
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel
from sangam.models import CheckpointError, TorchAttentionBackend, load_model, parse_config
from sangam.models.tokenizer import stop_token_ids
from sangam.sampling_params import CACHE_MODES, SamplingParams
from sangam.testing import make_tiny_checkpoint, real_shape_config, tiny_config

# (name, make_tiny_checkpoint overrides): the released layout (MHA, every layer MoE, no shared
# expert), and one with GQA, a dense first layer and a shared expert (upstream allows both).
VARIANTS = {
    "released": {},
    "dense_first_shared_gqa": dict(num_heads=4, num_kv_heads=2, moe={
        "moe_layer_freq": [0, 1], "shared_expert_intermediate_size": 48}),
}


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    return {name: make_tiny_checkpoint(tmp_path_factory.mktemp(name), arch="llada_moe",
                                       seed=11 + i, **kw)
            for i, (name, kw) in enumerate(VARIANTS.items())}


def _model(path):
    m = load_model(path, "cpu", "float64")
    m.attention_backend = TorchAttentionBackend()
    return m


def _reference_logits(path: str, ids: list[int]) -> torch.Tensor:
    """LLaDA-MoE's forward for one sequence from the checkpoint's tensors alone, in float64 with
    plain loops: modeling_lladamoe.py's semantics (pre-norm layers; per-head q/k RMSNorm over
    head_dim before rotate-half RoPE; bidirectional attention scaled by 1/sqrt(head_dim); a
    softmax router whose top-k probabilities weight the SwiGLU experts unnormalised; the
    layer's shared expert added; dense layers where moe_layer_freq is 0)."""
    cfg = json.loads(open(f"{path}/config.json").read())
    sd = {k: v.double() for k, v in load_file(f"{path}/model.safetensors").items()}
    hidden, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv, hd, eps = cfg["num_key_value_heads"], hidden // nh, cfg["rms_norm_eps"]
    t = len(ids)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def swiglu(x, p):
        gate = x @ sd[p + "gate_proj.weight"].T
        return (torch.nn.functional.silu(gate) * (x @ sd[p + "up_proj.weight"].T)) @ sd[
            p + "down_proj.weight"].T

    rot = int(hd * cfg["partial_rotary_factor"])
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(x):  # [T, heads, hd]
        xr, rest = x[..., :rot], x[..., rot:]
        half = rot // 2
        turned = torch.cat([-xr[..., half:], xr[..., :half]], -1)
        return torch.cat([xr * cos + turned * sin, rest], -1)

    h = sd["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(t, nh, hd)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
        q = rope(rms(q, sd[p + "self_attn.q_norm.weight"]))
        k = rope(rms(k, sd[p + "self_attn.k_norm.weight"]))
        heads = []
        for head in range(nh):
            kv_head = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(hd)
            heads.append(torch.softmax(scores, -1) @ v[:, kv_head])
        h = h + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        x = rms(h, sd[p + "post_attention_layernorm.weight"])
        if cfg["moe_layer_freq"][i] == 0:
            h = h + swiglu(x, p + "mlp.")
            continue
        probs = torch.softmax(x @ sd[p + "mlp.gate.weight"].T, -1)
        out = torch.zeros_like(x)
        for row in range(t):
            order = sorted(range(probs.shape[1]), key=lambda e: -probs[row, e].item())
            for e in order[:cfg["num_experts_per_tok"]]:
                out[row] += probs[row, e] * swiglu(x[row], f"{p}mlp.experts.{e}.")
        if cfg.get("shared_expert_intermediate_size"):
            out = out + swiglu(x, p + "shared_expert.")
        h = h + out
    return rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_dense_equals_the_upstream_semantics(moe_paths, variant):
    path = moe_paths[variant]
    model = _model(path)
    ids = torch.randint(0, 159, (2, 11), generator=torch.Generator().manual_seed(4))
    got = model.forward_dense(ids)
    for b in range(2):
        want = _reference_logits(path, ids[b].tolist())
        torch.testing.assert_close(got[b], want, rtol=1e-10, atol=1e-10)
    # The router actually chose: each MoE layer sent tokens to several different experts.
    layer = model.model.layers[1].mlp
    _, chosen = layer.route(torch.randn(32, model.config.hidden_size, dtype=torch.float64))
    assert len(set(chosen.flatten().tolist())) > model.config.moe.top_k


def test_tensor_names_are_the_checkpoints(moe_paths):
    names = set(load_file(f"{moe_paths['dense_first_shared_gqa']}/model.safetensors"))
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                 "model.layers.0.mlp.gate_proj.weight",  # dense first layer
                 "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight",
                 "model.layers.1.shared_expert.up_proj.weight",
                 "model.layers.1.self_attn.q_norm.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        assert name in names, name
    assert not any("shared_experts" in n or "expert_bias" in n for n in names)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_forward_equals_forward_dense(moe_paths, variant):
    model = _model(moe_paths[variant])
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 159, (n,), generator=g).tolist() for n in (13, 6, 19)]
    pages = [[5, 2, 9, 30], [0, 17], [1, 3, 4, 6, 8]]
    kv = _kv(model)
    logits = _forward(model, kv, seqs, [(0, len(s)) for s in seqs], pages)
    start = 0
    for s in seqs:
        dense = model.forward_dense(torch.tensor([s]))[0]
        torch.testing.assert_close(logits[start:start + len(s)], dense, rtol=1e-10, atol=1e-10)
        start += len(s)
    # A cached step over an unchanged span reads the stored K/V and gives the same rows.
    cached = _forward(model, kv, [seqs[2]], [(8, 15)], [pages[2]])
    torch.testing.assert_close(cached, model.forward_dense(torch.tensor([seqs[2]]))[0, 8:15],
                               rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_paged_forward_equals_forward_dense(moe_paths, variant):
    """The Triton backend: attention and the experts (moe_route, fused_moe) in the kernels."""
    from sangam.models.triton_attention import TritonAttentionBackend

    model = load_model(moe_paths[variant], "cpu", "float64")
    model.attention_backend = TritonAttentionBackend()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 159, (n,), generator=g).tolist() for n in (13, 6)]
    logits = _forward(model, _kv(model), seqs, [(0, len(s)) for s in seqs], [[5, 2, 9, 30],
                                                                            [0, 17]])
    dense = torch.cat([model.forward_dense(torch.tensor([s]))[0] for s in seqs])
    torch.testing.assert_close(logits, dense, rtol=1e-10, atol=1e-10)


def _requests():
    """Mixed prompts, thresholds, block lengths and every cache mode in one batch."""
    rng = random.Random(5)
    reqs = []
    for i in range(9):
        prompt = [rng.randrange(2, 150) for _ in range(rng.choice([1, 6, 15, 17]))]
        params = SamplingParams(
            max_tokens=rng.choice([8, 12]), block_length=rng.choice([4, 8]),
            cache=CACHE_MODES[i % 3], unmasking="threshold", threshold=[0.9, 0.5, 0.7][i // 3],
            temperature=rng.choice([0.0, 0.0, 2.0]), seed=i, stop_at_eos=i % 2 == 0)
        reqs.append((f"r{i}", prompt, params, None, []))
    return reqs


def test_engine_equals_reference_decoder_in_every_cache_mode(moe_paths):
    path = moe_paths["released"]
    lm = LoadedModel.load(EngineConfig(model=path, device="cpu", dtype="float64"))
    reqs = _requests()
    assert {p.cache for _, _, p, _, _ in reqs} == set(CACHE_MODES)
    cfg = EngineConfig(model=path, device="cpu", dtype="float64", token_budget=64, page_size=4,
                       num_pages=300)
    got = _run_staggered(Engine(cfg, lm), reqs, seed=2)
    want = _decode_one_by_one(lm, reqs)
    _assert_same(got, want)
    assert sum(len(tokens) for tokens, *_ in want.values()) > 50


def test_config_keys_defaults_and_refusals():
    raw = tiny_config("llada_moe", vocab_size=157184)  # the real vocabulary: its ids fit
    for key in ("mask_token_id", "eos_token_id", "rope_theta", "max_position_embeddings",
                "moe_layer_freq", "qk_layernorm", "partial_rotary_factor"):
        del raw[key]
    cfg = parse_config(raw)
    assert (cfg.mask_token_id, cfg.eos_token_id) == (156895, 156892)  # <|mask|>, <|endoftext|>
    assert (cfg.rope_theta, cfg.max_position, cfg.qk_norm, cfg.rotary_dim) == (
        50000.0, 8192, True, cfg.head_dim)
    assert cfg.moe.first_dense_layers == 0 and not cfg.moe.renormalize and cfg.moe.scale == 1.0
    assert not cfg.block_causal and not cfg.shift_logits
    # The upstream block reads neither of these: top-k probabilities stay as they are.
    same = parse_config({**raw, "norm_topk_prob": True, "routed_scaling_factor": 2.5})
    assert same.moe == cfg.moe
    assert parse_config({**raw, "architectures": ["LLaDAMoEModel"]}).moe == cfg.moe
    for bad, match in [({"moe_router_enable_expert_bias": True}, "expert_bias"),
                       ({"clip_qkv": 8.0}, "clip_qkv"),
                       ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
                       ({"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
                       ({"moe_layer_freq": [1]}, "moe_layer_freq"),
                       ({"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(CheckpointError, match=match):
            parse_config({**raw, **bad})


def test_real_shape_and_stop_ids():
    from sangam.bench.cost_model import MODELS

    cfg, g = parse_config(real_shape_config("llada-moe")), MODELS["llada-moe"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == (2048, 16, 16, 16, 128, 157184)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size,
            cfg.moe.shared_intermediate_size, cfg.moe.first_dense_layers) == (64, 8, 1024, 0, 0)
    assert g.intermediate == cfg.moe.top_k * cfg.moe.intermediate_size  # active MLP width

    class Vocab:  # a stand-in for the real tokenizer (these ids are illustrative)
        eos_token_id = 156892

        def get_vocab(self):
            return {"<|endoftext|>": 156892, "<|role_end|>": 156893, "<|mask|>": 156895}

    assert stop_token_ids(156892, Vocab()) == {156892, 156893}
