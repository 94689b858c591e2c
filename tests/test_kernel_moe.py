"""Mixture-of-experts kernels (router and fused experts) vs their PyTorch references.

CPU tensors under the Triton interpreter (fp32, fp64); bf16 on CUDA when a GPU is present. The
references are checked on their own too: the router on a hand-built example, the experts
against a per-token loop. Shapes are tiny: the interpreter costs milliseconds per program. The
last test compiles the kernels for the H200 at LLaDA2.0-mini's and -flash's expert shapes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from sangam.kernels import fused_moe, fused_moe_ref, moe_route, moe_route_ref
from sangam.kernels.cross_compile import H200

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CPU = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")
_GPU = [pytest.mark.gpu, pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                                             reason="needs CUDA (not interpreted)")]
CASES = [
    pytest.param("cpu", torch.float32, marks=_CPU, id="cpu-fp32"),
    pytest.param("cpu", torch.float64, marks=_CPU, id="cpu-fp64"),
    pytest.param("cuda", torch.bfloat16, marks=_GPU, id="cuda-bf16"),
]
FAST_CASES = [CASES[0], CASES[2]]
# fused_moe's output (x's dtype). bf16: the intermediate is rounded to bf16 as well.
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10),
       torch.bfloat16: (3e-2, 2e-2)}
# The router's weights: fp32 (fp64 for fp64 logits); the GPU's exp is approximate.
ROUTE_TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-5}


def _experts(e, h, i, device, dtype, seed=0):
    """Random expert weights scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=g, dtype=torch.float64) / math.sqrt(i)
    return w13.to(device, dtype), w2.to(device, dtype)


def _tokens(t, h, device, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g, dtype=torch.float64).to(device, dtype)


def _random_routing(t, e, k, device, seed=2, experts=None):
    """Distinct experts per token (from ``experts``, default all), weights in (0.1, 1)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(t)])
    weights = 0.1 + 0.9 * torch.rand(t, k, generator=g)
    return weights.to(device), ids.to(device, torch.int32)


def _check_moe(x, w13, w2, weights, ids, activation="silu", **kw):
    out = fused_moe(x, w13, w2, weights, ids, activation=activation, **kw)
    ref = fused_moe_ref(x, w13, w2, weights, ids, activation=activation)
    assert out.dtype == x.dtype and out.shape == x.shape
    atol, rtol = TOL[x.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


# ----------------------------------------------------------------------------- router

ROUTES = [
    # (E, top_k, n_group, topk_group): LLaDA2's grouped sigmoid in miniature, groups of one
    # expert, a group count that is not a power of two, and plain top-k.
    pytest.param(16, 4, 4, 2, id="E16-g4of2"),
    pytest.param(16, 3, 8, 3, id="E16-g8of3"),
    pytest.param(16, 4, 16, 5, id="E16-single-expert-groups"),
    pytest.param(12, 2, 3, 1, id="E12-g3of1"),
    pytest.param(60, 4, 1, 1, id="E60-ungrouped"),
]


def _logits(t, e, device, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g, dtype=torch.float64).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("e,top_k,n_group,topk_group", ROUTES)
def test_sigmoid_routing_with_bias_and_groups(device, dtype, e, top_k, n_group, topk_group):
    logits = _logits(37, e, device, dtype)
    bias = 0.3 * torch.randn(e, generator=torch.Generator().manual_seed(4)).to(device)
    kw = dict(top_k=top_k, score="sigmoid", bias=bias, n_group=n_group, topk_group=topk_group,
              scale=2.5)
    w, ids = moe_route(logits, **kw)
    rw, rids = moe_route_ref(logits, **kw)
    assert ids.dtype == torch.int32 and w.dtype == rw.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=ROUTE_TOL[dtype], rtol=ROUTE_TOL[dtype])
    torch.testing.assert_close(w.sum(1), torch.full_like(w[:, 0], 2.5))
    # Without a bias, and without renormalizing.
    kw.update(bias=None, renormalize=False, scale=1.0)
    w, ids = moe_route(logits, **kw)
    rw, rids = moe_route_ref(logits, **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=ROUTE_TOL[dtype], rtol=ROUTE_TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("e,top_k", [(8, 2), (64, 4), (60, 3)])
def test_softmax_routing(device, dtype, renormalize, e, top_k):
    logits = _logits(33, e, device, dtype, seed=5)
    kw = dict(top_k=top_k, score="softmax", renormalize=renormalize)
    w, ids = moe_route(logits, **kw)
    rw, rids = moe_route_ref(logits, **kw)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, atol=ROUTE_TOL[dtype], rtol=ROUTE_TOL[dtype])
    if not renormalize:  # the softmax probabilities themselves
        probs = torch.softmax(logits.double(), -1).gather(1, ids.long())
        torch.testing.assert_close(w.double(), probs, atol=1e-6, rtol=1e-6)


def _logit(p):
    return math.log(p / (1 - p))


def _kernel_device() -> str | None:
    """Where the kernels run in this process: CPU tensors under the interpreter, else CUDA."""
    if INTERPRET:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def test_router_reference_on_a_hand_built_example():
    """8 experts in 4 groups of 2, the 2 best groups kept. Group 0 holds the single best expert
    (0.95) but its top-2 sum (1.05) loses to groups 1 (0.80 + 0.75) and 2 (0.70 + 0.70). The
    kernel, where one can run, agrees."""
    s = [0.95, 0.10, 0.80, 0.75, 0.70, 0.70, 0.20, 0.30]
    logits = torch.tensor([[_logit(p) for p in s]], dtype=torch.float64)
    device = _kernel_device()

    def route(bias=None, **extra):
        b = None if bias is None else torch.tensor(bias, dtype=torch.float32)
        kw = dict(top_k=2, score="sigmoid", n_group=4, topk_group=2, bias=b) | extra
        w, ids = moe_route_ref(logits, **kw)
        if device is not None:
            kw["bias"] = None if b is None else b.to(device)
            got_w, got_ids = moe_route(logits.to(device), **kw)
            assert torch.equal(got_ids.cpu(), ids)
            torch.testing.assert_close(got_w.cpu(), w, atol=1e-12, rtol=1e-12)
        return w[0].tolist(), ids[0].tolist()

    w, ids = route()
    assert ids == [2, 3]
    assert w == pytest.approx([0.80 / 1.55, 0.75 / 1.55], abs=1e-12)
    w, _ = route(renormalize=False, scale=2.0)
    assert w == pytest.approx([1.60, 1.50], abs=1e-12)
    # A bias of 0.2 on expert 5 makes it the first choice; its weight stays its unbiased 0.70.
    w, ids = route([0, 0, 0, 0, 0, 0.2, 0, 0])
    assert ids == [5, 2]
    assert w == pytest.approx([0.70 / 1.50, 0.80 / 1.50], abs=1e-12)
    # Biases on experts 6 and 7 lift group 3 (0.65 + 0.85 = 1.50) over group 2 (1.40), and
    # expert 7 (biased score 0.85) over expert 2 (0.80): the weight is expert 7's own 0.30.
    w, ids = route([0, 0, 0, 0, 0, 0, 0.45, 0.55])
    assert ids == [7, 2]
    assert w == pytest.approx([0.30 / 1.10, 0.80 / 1.10], abs=1e-12)
    # Without groups (or with every group kept) the single best expert comes first.
    assert route(n_group=1, topk_group=1)[1] == [0, 2]
    assert route(topk_group=4)[1] == [0, 2]


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, marks=_CPU)])
def test_ties_go_to_the_lower_index(dtype):
    """Equal scores: the lower expert index, and the lower group index, win."""
    logits = torch.zeros(3, 16, dtype=dtype)
    logits[1, 9] = logits[1, 13] = 1.0  # two equal best experts, in groups 2 and 3
    for kw in (dict(score="softmax"), dict(score="sigmoid", n_group=4, topk_group=2)):
        w, ids = moe_route(logits, top_k=3, **kw)
        rw, rids = moe_route_ref(logits, top_k=3, **kw)
        assert torch.equal(ids, rids)
        torch.testing.assert_close(w, rw, atol=1e-12, rtol=1e-12)
    assert ids.tolist() == [[0, 1, 2], [9, 13, 8], [0, 1, 2]]
    assert rids.tolist() == ids.tolist()


@pytest.mark.parametrize("kw,message", [
    (dict(top_k=2, score="relu"), "score"),
    (dict(top_k=2, score="sigmoid", n_group=3), "n_group"),
    (dict(top_k=2, score="sigmoid", n_group=4, topk_group=5), "topk_group"),
    (dict(top_k=5, score="sigmoid", n_group=4, topk_group=2), "top_k"),
    (dict(top_k=0, score="softmax"), "top_k"),
    (dict(top_k=2, score="softmax", bias=torch.zeros(8)), "softmax"),
    (dict(top_k=2, score="softmax", n_group=2, topk_group=1), "softmax"),
    (dict(top_k=2, score="sigmoid", bias=torch.zeros(7)), "bias"),
])
def test_router_rejects_bad_arguments(kw, message):
    logits = torch.zeros(2, 8)
    for route in (moe_route_ref, moe_route):
        with pytest.raises(ValueError, match=message):
            route(logits, **kw)


# ----------------------------------------------------------------------------- experts


@pytest.mark.parametrize("device,dtype", CASES)
def test_random_routing(device, dtype):
    """40 tokens, 4 of 16 experts each; I = 48 is not a multiple of the tile."""
    w13, w2 = _experts(16, 64, 48, device, dtype)
    x = _tokens(40, 64, device, dtype)
    weights, ids = moe_route_ref(_logits(40, 16, device, dtype), top_k=4, score="sigmoid",
                                 n_group=4, topk_group=2, scale=2.5)
    _check_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("device,dtype", CASES)
def test_gelu_tanh_experts(device, dtype):
    """Gemma's GeGLU experts (DiffusionGemma): softmax top-2 of 8, odd widths."""
    w13, w2 = _experts(8, 40, 24, device, dtype)
    x = _tokens(13, 40, device, dtype)
    weights, ids = moe_route_ref(_logits(13, 8, device, dtype), top_k=2, score="softmax")
    _check_moe(x, w13, w2, weights, ids, activation="gelu_tanh")


def test_the_configs_activations_are_the_kernels():
    from sangam.kernels.reference import MOE_ACTIVATIONS
    from sangam.models.config import EXPERT_ACTIVATIONS

    assert EXPERT_ACTIVATIONS == MOE_ACTIVATIONS


def test_unknown_activation_is_refused():
    w13, w2 = _experts(4, 16, 16, "cpu", torch.float32)
    x = _tokens(2, 16, "cpu", torch.float32)
    ids = torch.tensor([[0, 2], [1, 3]], dtype=torch.int32)
    for fn in (fused_moe, fused_moe_ref):
        with pytest.raises(ValueError, match="activation"):
            fn(x, w13, w2, torch.ones(2, 2), ids, activation="relu")


@pytest.mark.parametrize("device,dtype", CASES)
def test_experts_without_tokens_and_odd_sizes(device, dtype):
    """Half the experts get no token (no tile); H and I are not multiples of the K tiles."""
    w13, w2 = _experts(16, 40, 24, device, dtype)
    x = _tokens(9, 40, device, dtype)
    weights, ids = _random_routing(9, 16, 3, device, experts=[1, 4, 6, 7, 11, 12, 14])
    _check_moe(x, w13, w2, weights, ids)


@pytest.mark.parametrize("device,dtype", CASES)
def test_all_tokens_to_one_expert(device, dtype):
    """One expert gets every token (three tiles of 16), then each token's second expert is
    another single one."""
    w13, w2 = _experts(8, 32, 16, device, dtype)
    x = _tokens(35, 32, device, dtype)
    ids = torch.full((35, 1), 3, dtype=torch.int32, device=device)
    weights = torch.rand(35, 1, generator=torch.Generator().manual_seed(0)).to(device)
    _check_moe(x, w13, w2, weights, ids)
    ids2 = torch.cat([ids, torch.full_like(ids, 5)], 1)
    _check_moe(x, w13, w2, torch.cat([weights, 1 - weights], 1), ids2)


@pytest.mark.parametrize("device,dtype", CASES)
def test_one_token(device, dtype):
    w13, w2 = _experts(8, 32, 32, device, dtype)
    weights, ids = _random_routing(1, 8, 2, device)
    _check_moe(_tokens(1, 32, device, dtype), w13, w2, weights, ids)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
@pytest.mark.parametrize("block_m", [16, 32])
def test_token_counts_off_the_tile(device, dtype, block_m):
    """21 tokens x 2 experts over 8 experts: runs that end mid-tile, at either tile height."""
    w13, w2 = _experts(8, 32, 16, device, dtype)
    weights, ids = _random_routing(21, 8, 2, device, seed=7)
    _check_moe(_tokens(21, 32, device, dtype), w13, w2, weights, ids, block_m=block_m)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
def test_no_tokens(device, dtype):
    w13, w2 = _experts(8, 32, 16, device, dtype)
    x = _tokens(0, 32, device, dtype)
    ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    out = fused_moe(x, w13, w2, torch.empty(0, 2, device=device), ids)
    assert out.shape == (0, 32)


def _gelu_tanh(g):
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


def _naive_moe(x, w13, w2, weights, ids, activation="silu"):
    """Token by token, expert by expert, in fp64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = w13[e, :inter].double() @ xt
            up = w13[e, inter:].double() @ xt
            act = (gate * torch.sigmoid(gate) if activation == "silu" else _gelu_tanh(gate)) * up
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_matches_a_per_token_loop(dtype, activation):
    w13, w2 = _experts(8, 24, 20, "cpu", dtype)
    x = _tokens(11, 24, "cpu", dtype)
    weights, ids = _random_routing(11, 8, 3, "cpu", seed=9)
    ref = fused_moe_ref(x, w13, w2, weights, ids, activation=activation)
    assert ref.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ref.double(), _naive_moe(x, w13, w2, weights, ids, activation),
                               atol=tol, rtol=tol)


def test_reference_rejects_a_token_routed_twice_to_one_expert():
    w13, w2 = _experts(4, 16, 16, "cpu", torch.float32)
    x = _tokens(2, 16, "cpu", torch.float32)
    ids = torch.tensor([[0, 2], [1, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="twice"):
        fused_moe_ref(x, w13, w2, torch.ones(2, 2), ids)


@pytest.mark.parametrize("device,dtype", CASES)
def test_batch_invariance(device, dtype):
    """A token's output is bitwise the same alone as among 32 others, and again in a batch
    whose other tokens are different (so its tiles hold other rows)."""
    w13, w2 = _experts(16, 32, 32, device, dtype)
    x = _tokens(33, 32, device, dtype)
    weights, ids = _random_routing(33, 16, 4, device, seed=11)
    batch = fused_moe(x, w13, w2, weights, ids)
    others = _tokens(33, 32, device, dtype, seed=12)
    mixed_x = torch.cat([others[:20], x[17:18], others[20:32]])
    mixed_w = torch.cat([weights[5:25], weights[17:18], weights[:12]])
    mixed_ids = torch.cat([ids[5:25], ids[17:18], ids[:12]])
    mixed = fused_moe(mixed_x, w13, w2, mixed_w, mixed_ids)
    assert torch.equal(mixed[20], batch[17])
    for t in (0, 17, 32):
        alone = fused_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone[0], batch[t]), t
    again = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(again, batch)


@pytest.mark.parametrize("device,dtype", [CASES[2]])
def test_cuda_graph_replay_without_host_sync(device, dtype):
    """Routing and experts read nothing back to the host (sync debug mode 'error'), so one
    CUDA graph replays them for any routing: new logits and tokens copied into the captured
    inputs give the reference's result for the new routing."""
    w13, w2 = _experts(16, 64, 32, device, dtype)
    x = _tokens(24, 64, device, dtype)
    logits = _logits(24, 16, device, torch.float32)
    kw = dict(top_k=4, score="sigmoid", n_group=4, topk_group=2, scale=2.5)

    def forward():
        w, ids = moe_route(logits, **kw)
        return w, ids, fused_moe(x, w13, w2, w, ids)

    forward()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids, out = forward()
    logits.copy_(_logits(24, 16, device, torch.float32, seed=21))
    x.copy_(_tokens(24, 64, device, dtype, seed=22))
    graph.replay()
    torch.cuda.synchronize()
    ref_w, ref_ids = moe_route_ref(logits, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=ROUTE_TOL[dtype], rtol=ROUTE_TOL[dtype])
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, w, ids), atol=atol, rtol=rtol)


def test_sizes_depend_on_shapes_only():
    """The sorted pairs and the tile map have the same sizes for any routing: T*K rows plus
    BLOCK_M - 1 of padding for each expert that can be used (at most min(E, T*K)): here
    24 + 16 * 15 = 264 rows, 17 tiles of 16."""
    from sangam.kernels.fused_moe import moe_align

    spread = torch.arange(24, dtype=torch.int32).view(12, 2) % 16
    packed = torch.zeros(12, 2, dtype=torch.int32)
    packed[:, 1] = 1
    for ids in (spread, packed, torch.empty(12, 2, dtype=torch.int32, device="meta")):
        pairs, tile_expert = moe_align(ids, 16, 16)
        assert pairs.shape == (17 * 16,) and tile_expert.shape == (17,)
    pairs, tile_expert = moe_align(packed, 16, 16)
    # Expert 0's 12 pairs fill one tile, expert 1's the next; the other tiles are past the end.
    assert tile_expert.tolist() == [0, 1] + [16] * 15
    assert pairs[:16].tolist() == list(range(0, 24, 2)) + [24] * 4
    assert pairs[16:32].tolist() == list(range(1, 24, 2)) + [24] * 4


# ----------------------------------------------------------------------------- H200 build

_COMPILE = """
import dataclasses, json, sys, torch
from sangam.kernels import fused_moe, moe_route
from sangam.kernels.cross_compile import cross_compiling

meta = torch.device("meta")
out = []
for name, hidden, inter in (("mini", 2048, 512), ("flash", 4096, 1024)):
    for tokens in (64, 1024, 2048):
        def empty(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device=meta)
        with cross_compiling() as builds:
            w, ids = moe_route(empty(tokens, 256), top_k=8, score="sigmoid",
                               bias=empty(256, dtype=torch.float32), n_group=8, topk_group=4,
                               scale=2.5)
            fused_moe(empty(tokens, hidden), empty(256, 2 * inter, hidden),
                      empty(256, hidden, inter), w, ids)
        out += [dataclasses.asdict(b) | {"model": name, "tokens": tokens,
                                         "text": b.describe()} for b in builds]
json.dump(out, sys.stdout, default=str)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU launches these for real")
def test_moe_kernels_compile_for_h200_without_spills():
    """LLaDA2.0-mini's (H 2048, I 512) and -flash's (H 4096, I 1024) experts, 256 of them, 8
    per token, in bf16, for a 2-request decode step (64 tokens), a 1024-token chunk (the
    engine's default token budget) and a 2048-token prefill."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = json.loads(proc.stdout)
    for model in ("mini", "flash"):
        for tokens in (64, 1024, 2048):
            kernels = {b["kernel"] for b in builds
                       if b["model"] == model and b["tokens"] == tokens}
            assert kernels == {"_route_kernel", "_gate_up_kernel", "_down_kernel",
                               "_combine_kernel"}, (model, tokens)
    # Decode tiles hold 16 rows, prefill tiles 32 or 64; both GEMMs run on tensor cores.
    gemms = [b for b in builds if b["kernel"] in ("_gate_up_kernel", "_down_kernel")]
    assert {(b["tokens"], b["constants"]["BLOCK_M"]) for b in gemms} == {
        (64, 16), (1024, 32), (2048, 64)}
    assert all(b["mma"] != "none" for b in gemms)
    for b in builds:
        assert b["spill_bytes"] == 0, b["text"]
        assert b["shared_bytes"] <= H200.max_shared_bytes, b["text"]
        assert 0 < b["registers"] <= 255, b["text"]
