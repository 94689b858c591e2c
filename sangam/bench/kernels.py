"""``sangam-bench kernels``: time the Triton kernels at the shapes of the real models.

Models: LLaDA-8B (32 query heads / 32 KV heads, head_dim 128), Dream-7B (28 / 4, head_dim
128) and SDAR-8B (32 / 8, head_dim 128) under its block-causal mask
(blocks of 4); bf16, pages of 16 tokens.

  attention  cached steps: spans of 32 queries x batch 1, 4, 16, 64 x KV length 512-4096
             (memory-bound: reported as GB/s of K/V read)
  refresh    one request's full forward: 512-4096 queries over as many keys (TFLOP/s)
  unmask     fused confidence scoring (each row's token and confidence, what the unmasking
             rules commit by) over 32-2048 rows of 126464 logits, temperature 0 and 1 (GB/s
             of logits read)
  gather     KV-transfer page gather of 1-16 requests of 1024 tokens, all layers (GB/s read +
             written)
  canvas     DiffusionGemma's canvas steps: 256 queries per request x batch 1, 4, 16, 64 x KV
             length 512-4096 (the canvas last), each query's keys bounded as the engine packs
             them (canvas_key_bounds): sliding layers (16 query / 8 KV heads, head_dim 256,
             a 512-position window) and full layers (16 / 2, head_dim 512) (GB/s of K/V read)
  moe        the routed experts of LLaDA2.0-mini (H 2048, I 512) and LLaDA2.0-flash (H 4096,
             I 1024), 256 experts, 8 per token, sigmoid-routed in 8 groups of which 4 are kept,
             SwiGLU; and Gemma 4 26B-A4B's (H 2816, I 704, 128 experts, 8 per token,
             softmax-routed, GeGLU): fused_moe (sort by expert, gate+up, down, top-k combine)
             over the tokens of a decode step, 32 per request x 1, 2, 4, 16, 64 requests
             (TFLOP/s of 2 T K 3 H I flops; routing not included); --moe-models picks the shapes
  fp8        FP8 weights (128 x 128 block scales, activations quantized per token and group of
             128 in the prologue): fp8_linear at LLaDA-8B's projections (4096 -> 4096, 4096 ->
             12288, 12288 -> 4096) over the tokens of 1, 8 and 64 requests' decode steps, and
             fused_moe's FP8 form at the moe suite's expert shapes (TFLOP/s against the H200's
             1,979 dense FP8 peak; the reference column is the bf16 layer FP8 replaces:
             torch's matmul, or fused_moe on bf16 experts)

Each row: kernel time (median, triton.testing.do_bench), achieved GB/s or TFLOP/s and the
fraction of the H200's peak (4.8 TB/s HBM, 989 TFLOP/s dense bf16), the PyTorch reference's
time (attention: page gather + SDPA; unmasking: score_logits; gather: advanced indexing;
moe: fused_moe_ref, one expert at a time) and the speedup over it, and FlashInfer's paged
attention where it is importable. Results print as a table; --json FILE writes them with the
device and versions.

Without a GPU, timings are meaningless: the command says so, runs a correctness pass of every
kernel at tiny shapes under the Triton interpreter, then compiles every launch of the suites
above (and the engine's K/V store, and the MoE router, at the same shapes) for the GPU named by
--gpu (default H200) with Triton's own ptxas, printing each build's registers per thread,
spilled bytes, shared memory, 16-byte vs narrower global loads and tensor-core instructions, and
exits 0.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sangam.models.checkpoint import SDAR_BLOCK_SIZE
from sangam.models.registry import MODEL_SHAPES, ModelShape

# The H200 SXM's peaks, from NVIDIA's H200 datasheet: 4.8 TB/s of HBM3e bandwidth, and 1,979
# TFLOP/s of bf16 tensor-core math with 2:4 sparsity, so 989 TFLOP/s dense.
PEAK_BYTES_PER_S = 4.8e12
PEAK_FLOPS = 989e12
PEAK_FP8_FLOPS = 1979e12  # dense FP8 (e4m3) tensor-core math, the same datasheet
# LLaDA-8B's projections as (name, N outputs, K inputs): what the fp8 suite times.
FP8_PROJECTIONS = (("attn 4096>4096", 4096, 4096), ("up 4096>12288", 12288, 4096),
                   ("down 12288>4096", 4096, 12288))
# The models timed, of sangam.models.registry: name -> (query heads, KV heads, head_dim, layers)
MODELS = {key: (MODEL_SHAPES[key].num_heads, MODEL_SHAPES[key].num_kv_heads,
                MODEL_SHAPES[key].head_dim, MODEL_SHAPES[key].num_layers)
          for key in ("llada", "dream", "sdar")}
# Block-causal models' block size in the suites: SDAR's default.
CAUSAL_BLOCK = {key: SDAR_BLOCK_SIZE for key in MODELS if MODEL_SHAPES[key].block_causal}
VOCAB = MODEL_SHAPES["llada"].vocab_size
PAGE = 16
SUITES = ("attention", "refresh", "canvas", "unmask", "gather", "moe", "fp8")
# DiffusionGemma's attention layers, by kind: (query heads, KV heads, head_dim, window; None:
# full). Gemma 4 26B-A4B's text geometry (NVIDIA Megatron-Bridge's Gemma 4 provider: sliding
# layers head_dim 256 with 8 KV heads, full layers 512 with 2; 16 query heads), assumed to be
# DiffusionGemma-26B-A4B's, no release config of which can be read here; the window is
# DiffusionGemma's 512 (Gemma 4's is 1024).
GEMMA_LAYERS = {"gemma-sliding": (16, 8, 256, 512), "gemma-full": (16, 2, 512, None)}
GEMMA_CANVAS = 256


@dataclass(frozen=True)
class MoeShape:
    """A mixture-of-experts layer's routed experts and router, read off a registry shape
    (sigmoid scores with a selection bias, as LLaDA2's)."""

    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    scale: float
    score: str = "sigmoid"
    activation: str = "silu"

    @classmethod
    def of(cls, shape: ModelShape) -> MoeShape:
        m = shape.moe
        return cls(shape.name, shape.hidden_size, m.intermediate_size, m.num_experts, m.top_k,
                   m.n_group, m.topk_group, m.routed_scaling_factor)

    def route(self, logits: torch.Tensor, bias: torch.Tensor):
        """moe_route's (weights, ids) for router ``logits``, as the model routes them."""
        from sangam.kernels import moe_route

        if self.score == "softmax":  # Gemma 4: softmax, top-k renormalised, no groups
            return moe_route(logits, top_k=self.top_k, score="softmax", renormalize=True)
        return moe_route(logits, top_k=self.top_k, score=self.score, bias=bias,
                         n_group=self.n_group, topk_group=self.topk_group, scale=self.scale)


MOE_MODELS = {key: MoeShape.of(MODEL_SHAPES[key]) for key in ("llada2-mini", "llada2-flash")}
# Gemma 4 26B-A4B's experts (its config.json: hidden 2816, moe_intermediate_size 704, 128
# experts, top_k_experts 8), assumed DiffusionGemma-26B-A4B's (see GEMMA_LAYERS).
MOE_MODELS["gemma4-26b-a4b"] = MoeShape("Gemma 4 26B-A4B", 2816, 704, 128, 8, 1, 1, 1.0,
                                        score="softmax", activation="gelu_tanh")
DEVICE = "cuda"


# ----------------------------------------------------------------------------- GPU timings

def _bench(fn: Callable[[], object], warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn``."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def _paged_batch(r: int, q_per_req: int, kv: int, hq: int, hkv: int, d: int, dev, dtype,
                 seed: int = 0):
    """Equal-length requests over shuffled pages; also the contiguous view for baselines."""
    g = torch.Generator(device=dev).manual_seed(seed)
    pages_per = -(-kv // PAGE)
    num_pages = r * pages_per
    table = torch.randperm(num_pages, device=dev, generator=g).view(r, pages_per).to(torch.int32)
    k_cache = torch.randn(num_pages, PAGE, hkv, d, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(num_pages, PAGE, hkv, d, device=dev, dtype=dtype, generator=g)
    q = torch.randn(r * q_per_req, hq, d, device=dev, dtype=dtype, generator=g)
    cu = torch.arange(0, r + 1, device=dev, dtype=torch.int32) * q_per_req
    kv_lens = torch.full((r,), kv, device=dev, dtype=torch.int32)
    return q, k_cache, v_cache, cu, table, kv_lens


def _causal_args(model: str, r: int, n_q: int, kv: int, dev) -> dict:
    """paged_attention's block-causal arguments for a batch of ``r`` spans of ``n_q`` queries
    ending at ``kv`` (none for a bidirectional model)."""
    bs = CAUSAL_BLOCK.get(model)
    if bs is None:
        return {}
    pos = torch.arange(kv - n_q, kv, device=dev).repeat(r)
    return {"causal_blocks": torch.full((r,), bs, dtype=torch.int32, device=dev),
            "positions": pos}


def _torch_attention(q, k_cache, v_cache, table, kv: int, q_per_req: int,
                     causal_block: int | None = None):
    """The PyTorch baseline: gather each request's pages, then one batched SDPA (GQA), under
    the block-causal mask when ``causal_block`` is given."""
    r = table.shape[0]
    hq, d = q.shape[1:]
    hkv = k_cache.shape[2]
    idx = table.long()
    k = k_cache[idx].flatten(1, 2)[:, :kv].transpose(1, 2)  # [R, Hkv, kv, D]
    v = v_cache[idx].flatten(1, 2)[:, :kv].transpose(1, 2)
    qq = q.view(r, q_per_req, hq, d).transpose(1, 2)
    mask = None
    if causal_block:
        q_blk = torch.arange(kv - q_per_req, kv, device=q.device) // causal_block
        mask = (torch.arange(kv, device=q.device) // causal_block)[None, :] <= q_blk[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        qq, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=hq != hkv)
    return out.transpose(1, 2).reshape(-1, hq, d)


def _flashinfer_attention(q, k_cache, v_cache, table, kv: int, q_per_req: int):
    """A FlashInfer paged-prefill closure (no causal mask), or None when unavailable."""
    try:
        import flashinfer
    except ImportError:
        return None
    r = table.shape[0]
    dev = q.device
    pages_per = table.shape[1]
    qo_indptr = torch.arange(0, r + 1, device=dev, dtype=torch.int32) * q_per_req
    kv_indptr = torch.arange(0, r + 1, device=dev, dtype=torch.int32) * pages_per
    last = torch.full((r,), kv - (pages_per - 1) * PAGE, device=dev, dtype=torch.int32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(qo_indptr, kv_indptr, table.flatten(), last, q.shape[1], k_cache.shape[2],
                 q.shape[2], PAGE, causal=False, q_data_type=q.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def _row(suite, model, shape, ms, work, unit, ref_ms=None, fi_ms=None, err=None,
         peak=None) -> dict:
    rate = work / (ms * 1e-3)
    peak = peak or (PEAK_BYTES_PER_S if unit == "GB/s" else PEAK_FLOPS)
    return {
        "suite": suite, "model": model, "shape": shape, "ms": ms,
        "rate": rate / (1e9 if unit == "GB/s" else 1e12), "unit": unit,
        "frac_peak": rate / peak, "ref_ms": ref_ms,
        "speedup_ref": None if ref_ms is None else ref_ms / ms,
        "flashinfer_ms": fi_ms, "speedup_flashinfer": None if fi_ms is None else fi_ms / ms,
        "max_abs_err": err,
    }


def _attention_rows(model, batches, kvs, q_per_req, suite, args) -> list[dict]:
    from sangam.kernels.paged_attention import paged_attention

    hq, hkv, d, _ = MODELS[model]
    rows = []
    for r in batches:
        for kv in kvs:
            q, kc, vc, cu, table, kvl = _paged_batch(r, q_per_req or kv, kv, hq, hkv, d,
                                                     DEVICE, torch.bfloat16)
            n_q = q_per_req or kv
            causal = _causal_args(model, r, n_q, kv, DEVICE)

            def run(q=q, kc=kc, vc=vc, cu=cu, table=table, kvl=kvl, n_q=n_q, causal=causal):
                return paged_attention(q, kc, vc, cu, table, kvl, d ** -0.5, max_query_len=n_q,
                                       **causal)

            def ref(q=q, kc=kc, vc=vc, table=table, kv=kv, n_q=n_q):
                return _torch_attention(q, kc, vc, table, kv, n_q, CAUSAL_BLOCK.get(model))

            err = (run().float() - ref().float()).abs().max().item()
            ms = _bench(run, args.warmup, args.rep)
            ref_ms = _bench(ref, args.warmup, args.rep)
            fi_ms = None
            try:  # FlashInfer has no block-causal mask
                fi = None if causal else _flashinfer_attention(q, kc, vc, table, kv, n_q)
                if fi is not None:
                    fi_ms = _bench(fi, args.warmup, args.rep)
            except Exception as exc:  # an API drift must not sink the other numbers
                print(f"  flashinfer failed: {exc!r}", file=sys.stderr)
            if suite == "attention":
                work = 2 * r * kv * hkv * d * 2 + 2 * q.numel() * 2  # K+V read, q in, out
                unit = "GB/s"
            else:  # block-causal: the keys each query sees, about half of a prefill's
                seen = kv * (kv + CAUSAL_BLOCK[model]) / 2 if causal else n_q * kv
                work = 4 * r * seen * hq * d
                unit = "TFLOP/s"
            shape = f"B={r} q={n_q} kv={kv}"
            rows.append(_row(suite, model, shape, ms, work, unit, ref_ms, fi_ms, err))
            _print_row(rows[-1])
            del q, kc, vc
    return rows


def _canvas_bounds(r: int, kv: int, window: int | None, dev) -> tuple[torch.Tensor, ...]:
    """The key bounds of ``r`` canvases of GEMMA_CANVAS queries ending at ``kv`` (the
    engine's ``canvas_key_bounds``): each sees [0, kv), a sliding layer [s - window + 1, kv)."""
    import numpy as np

    from sangam.models.diffusion_gemma import canvas_key_bounds

    n = r * GEMMA_CANVAS
    s = kv - GEMMA_CANVAS
    lo, hi, wlo = canvas_key_bounds(np.full(n, s), np.full(n, s), np.full(n, kv),
                                    window or kv + 1)
    first = lo if window is None else wlo
    return torch.from_numpy(first).to(dev), torch.from_numpy(hi).to(dev)


def _canvas_rows(layer: str, batches, kvs, args) -> list[dict]:
    from sangam.kernels.paged_attention import paged_attention
    from sangam.kernels.reference import paged_attention_ref

    hq, hkv, d, window = GEMMA_LAYERS[layer]
    rows = []
    for r in batches:
        for kv in kvs:
            q, kc, vc, cu, table, kvl = _paged_batch(r, GEMMA_CANVAS, kv, hq, hkv, d, DEVICE,
                                                     torch.bfloat16)
            bounds = _canvas_bounds(r, kv, window, DEVICE)

            def run(q=q, kc=kc, vc=vc, cu=cu, table=table, kvl=kvl, bounds=bounds):
                return paged_attention(q, kc, vc, cu, table, kvl, 1.0,
                                       max_query_len=GEMMA_CANVAS, key_bounds=bounds)

            def ref(q=q, kc=kc, vc=vc, cu=cu, table=table, kvl=kvl, bounds=bounds):
                return paged_attention_ref(q, kc, vc, cu, table, kvl, 1.0, key_bounds=bounds)

            err = (run().float() - ref().float()).abs().max().item()
            ms = _bench(run, args.warmup, args.rep)
            ref_ms = _bench(ref, args.warmup, args.rep)
            seen = kv if window is None else min(kv, window - 1 + GEMMA_CANVAS)
            work = 2 * r * seen * hkv * d * 2 + 2 * q.numel() * 2  # K/V read, q in, out
            rows.append(_row("canvas", layer, f"B={r} q={GEMMA_CANVAS} kv={kv}", ms, work,
                             "GB/s", ref_ms, None, err))
            _print_row(rows[-1])
            del q, kc, vc
    return rows


def _score_rows(row_counts, args) -> list[dict]:
    from sangam.decoding import score_logits
    from sangam.kernels.unmask import fused_score

    rows = []
    dev = DEVICE
    for m in row_counts:
        for temp in (0.0, 1.0):
            logits = 3 * torch.randn(m, VOCAB, device=dev, dtype=torch.bfloat16)
            keys = torch.randint(0, 2**32, (m,), device=dev)
            rows_temp = torch.full((m,), temp, device=dev, dtype=torch.float64)

            def run(logits=logits, keys=keys, rows_temp=rows_temp):
                return fused_score(logits, VOCAB - 128, rows_temp, keys)

            def ref(logits=logits, keys=keys, rows_temp=rows_temp):
                return score_logits(logits, VOCAB - 128, rows_temp, keys)

            tok, _ = run()
            rtok, _, _ = ref()
            err = float((tok != rtok).float().mean().item())  # fraction of differing tokens
            ms = _bench(run, args.warmup, args.rep)
            ref_ms = _bench(ref, args.warmup, args.rep)
            row = _row("unmask", "-", f"rows={m} V={VOCAB} t={temp:g}", ms, m * VOCAB * 2,
                       "GB/s", ref_ms, err=err)
            rows.append(row)
            _print_row(row)
    return rows


def _gather_rows(model, request_counts, tokens_per_req, args) -> list[dict]:
    from sangam.kernels.page_copy import gather_pages

    _, hkv, d, layers = MODELS[model]
    pages_per = tokens_per_req // PAGE
    rows = []
    for n_req in request_counts:
        n = n_req * pages_per
        pool = torch.randn(layers, 2, n + 64, PAGE, hkv, d, device=DEVICE, dtype=torch.bfloat16)
        ids = torch.randperm(n + 64, device=DEVICE)[:n].to(torch.int32)
        run = lambda pool=pool, ids=ids: gather_pages(pool, ids)  # noqa: E731
        ref = lambda pool=pool, ids=ids: pool[:, :, ids.long()]  # noqa: E731
        err = float((run() != ref()).sum().item())  # count of differing elements
        ms = _bench(run, args.warmup, args.rep)
        ref_ms = _bench(ref, args.warmup, args.rep)
        moved = 2 * layers * 2 * n * PAGE * hkv * d * 2  # read + write
        row = _row("gather", model, f"requests={n_req} x {tokens_per_req} tok", ms, moved,
                   "GB/s", ref_ms, err=err)
        rows.append(row)
        _print_row(row)
        del pool
    return rows


def _moe_rows(model: str, token_counts, args) -> list[dict]:
    from sangam.kernels import fused_moe, fused_moe_ref

    m = MOE_MODELS[model]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(m.experts, 2 * m.inter, m.hidden, device=DEVICE, dtype=torch.bfloat16,
                      generator=g) * m.hidden ** -0.5
    w2 = torch.randn(m.experts, m.hidden, m.inter, device=DEVICE, dtype=torch.bfloat16,
                     generator=g) * m.inter ** -0.5
    bias = 0.1 * torch.randn(m.experts, device=DEVICE, generator=g)
    rows = []
    act = m.activation
    for t in token_counts:
        x = torch.randn(t, m.hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, m.experts, device=DEVICE, generator=g)
        weights, ids = m.route(logits, bias)
        run = lambda x=x, w=weights, i=ids: fused_moe(x, w13, w2, w, i,  # noqa: E731
                                                      activation=act)
        ref = lambda x=x, w=weights, i=ids: fused_moe_ref(x, w13, w2, w, i,  # noqa: E731
                                                          activation=act)
        err = (run().float() - ref().float()).abs().max().item()
        ms = _bench(run, args.warmup, args.rep)
        ref_ms = _bench(ref, args.warmup, args.rep)
        flops = 2 * t * m.top_k * 3 * m.hidden * m.inter
        row = _row("moe", model, f"T={t} E={m.experts} k={m.top_k}", ms, flops, "TFLOP/s",
                   ref_ms, err=err)
        rows.append(row)
        _print_row(row)
    return rows


def _fp8_weights(e: int, n: int, k: int, g: torch.Generator):
    """Random FP8 weights ``[e, n, k]`` with 128 x 128 block scales (N(0, 1/k) overall)."""
    w = torch.randn(e, n, k, device=DEVICE, generator=g).to(torch.float8_e4m3fn)
    scale = torch.full((e, -(-n // 128), -(-k // 128)), k ** -0.5, device=DEVICE)
    return w, scale


def _fp8_rows(token_counts, args) -> list[dict]:
    import functools

    import torch.nn.functional as F

    from sangam.kernels import fused_moe
    from sangam.kernels.fp8_gemm import fp8_linear
    from sangam.kernels.reference import dequantize_fp8_experts, dequantize_fp8_ref

    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []

    def timed(model: str, shape: str, run, ref, flops: int) -> None:
        err = (run().float() - ref().float()).abs().max().item()
        ms, ref_ms = _bench(run, args.warmup, args.rep), _bench(ref, args.warmup, args.rep)
        rows.append(_row("fp8", model, shape, ms, flops, "TFLOP/s", ref_ms, err=err,
                         peak=PEAK_FP8_FLOPS))
        _print_row(rows[-1])

    for name, n, k in FP8_PROJECTIONS:
        w, scale = _fp8_weights(1, n, k, g)
        w, scale = w[0], scale[0]
        w_bf16 = dequantize_fp8_ref(w, scale, torch.bfloat16, block=True)
        for t in token_counts:
            x = torch.randn(t, k, device=DEVICE, dtype=torch.bfloat16, generator=g)
            timed("llada", f"{name} T={t}",
                  functools.partial(fp8_linear, x, w, scale, block_weights=True),
                  functools.partial(F.linear, x, w_bf16), 2 * t * n * k)
    for model in filter(None, args.moe_models.split(",")):
        m = MOE_MODELS[model]
        w13, s13 = _fp8_weights(m.experts, 2 * m.inter, m.hidden, g)
        w2, s2 = _fp8_weights(m.experts, m.hidden, m.inter, g)
        if m.inter % 128:  # the gate's and the up's blocks each their own
            s13 = torch.cat([s13[:, :-(-m.inter // 128)]] * 2, dim=1)
        b13 = dequantize_fp8_experts(w13, s13, torch.bfloat16, True, gate_up=True)
        b2 = dequantize_fp8_experts(w2, s2, torch.bfloat16, True)
        bias = 0.1 * torch.randn(m.experts, device=DEVICE, generator=g)
        for t in token_counts:
            x = torch.randn(t, m.hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
            weights, ids = m.route(torch.randn(t, m.experts, device=DEVICE, generator=g), bias)
            timed(model, f"moe T={t} E={m.experts} k={m.top_k}",
                  functools.partial(fused_moe, x, w13, w2, weights, ids, w13_scale=s13,
                                    w2_scale=s2, block_weights=True, activation=m.activation),
                  functools.partial(fused_moe, x, b13, b2, weights, ids,
                                    activation=m.activation),
                  2 * t * m.top_k * 3 * m.hidden * m.inter)
    return rows


_HEADER = (f"{'suite':<9} {'model':<12} {'shape':<26} {'ms':>8} {'rate':>16} {'%peak':>6} "
           f"{'ref ms':>8} {'x ref':>6} {'fi ms':>8} {'x fi':>6} {'err':>8}")


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _print_row(row: dict) -> None:
    print(f"{row['suite']:<9} {row['model']:<12} {row['shape']:<26} {row['ms']:>8.4f} "
          f"{row['rate']:>8.1f} {row['unit']:<7} {100 * row['frac_peak']:>6.1f} "
          f"{_fmt(row['ref_ms'], '8.4f'):>8} {_fmt(row['speedup_ref'], '6.2f'):>6} "
          f"{_fmt(row['flashinfer_ms'], '8.4f'):>8} {_fmt(row['speedup_flashinfer'], '6.2f'):>6}"
          f" {_fmt(row['max_abs_err'], '8.2g'):>8}", flush=True)


@dataclass(frozen=True)
class Shapes:
    """The serving shapes every suite runs at (timed on a GPU, cross-compiled without one)."""

    batches: tuple[int, ...]  # cached steps: requests of 32 queries
    kvs: tuple[int, ...]  # their KV lengths
    refresh: tuple[int, ...]  # refresh lengths (queries = keys)
    gather: tuple[int, ...]  # requests of GATHER_TOKENS tokens per gather
    unmask: tuple[int, ...]  # logits rows

    @classmethod
    def of(cls, quick: bool) -> Shapes:
        if quick:
            return cls((1, 16, 64), (512, 4096), (512, 4096), (1, 4, 16), (32, 2048))
        return cls((1, 4, 16, 64), (512, 1024, 2048, 4096), (512, 1024, 2048, 4096),
                   (1, 2, 4, 8, 16), (32, 256, 2048))

    @property
    def moe_tokens(self) -> tuple[int, ...]:
        """The MoE suite's token counts: decode steps of the cached-step batches, and of 2
        requests (the engine's smallest shared step)."""
        return tuple(STEP_QUERIES * r for r in sorted({2, *self.batches}))

    @property
    def fp8_tokens(self) -> tuple[int, ...]:
        """The fp8 suite's token counts: decode steps of 1, 8 and 64 requests."""
        return tuple(STEP_QUERIES * r for r in (1, 8, 64))


STEP_QUERIES = 32
GATHER_TOKENS = 1024


def run_gpu(args: argparse.Namespace, save: Callable[[list[dict]], None]) -> list[dict]:
    """Every selected suite; ``save(rows)`` after each, so a run cut short keeps its numbers."""
    suites = args.suites.split(",")
    shapes = Shapes.of(args.quick)
    print(_HEADER)
    rows: list[dict] = []
    for model in args.models.split(","):
        if "attention" in suites:
            rows += _attention_rows(model, shapes.batches, shapes.kvs, STEP_QUERIES,
                                    "attention", args)
            save(rows)
        if "refresh" in suites:
            rows += _attention_rows(model, [1], shapes.refresh, None, "refresh", args)
            save(rows)
        if "gather" in suites:
            rows += _gather_rows(model, shapes.gather, GATHER_TOKENS, args)
            save(rows)
    if "canvas" in suites:
        for layer in GEMMA_LAYERS:
            rows += _canvas_rows(layer, shapes.batches, shapes.kvs, args)
            save(rows)
    if "unmask" in suites:
        rows += _score_rows(shapes.unmask, args)
        save(rows)
    if "moe" in suites:
        for model in args.moe_models.split(","):
            rows += _moe_rows(model, shapes.moe_tokens, args)
            save(rows)
    if "fp8" in suites:
        rows += _fp8_rows(shapes.fp8_tokens, args)
        save(rows)
    return rows


# ----------------------------------------------------------------------------- cross-compile

def cross_compile_builds(gpu: str = "H200", models: str = "llada,dream,sdar",
                         quick: bool = False,
                         moe_models: str = ",".join(MOE_MODELS)) -> list[dict]:
    """Compile, for ``gpu`` (a name in ``cross_compile.TARGETS``), every launch the suites and
    the engine's Triton backend make at the serving shapes, on meta tensors. Needs compiled
    kernels (no ``TRITON_INTERPRET``); no GPU. Returns one dict per distinct build."""
    from sangam.kernels import (
        fused_moe,
        fused_score,
        gather_pages,
        paged_attention,
        scatter_pages,
        store_kv,
    )
    from sangam.kernels.cross_compile import TARGETS, cross_compiling

    if gpu not in TARGETS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(TARGETS)}")

    from sangam.kernels.fp8_gemm import fp8_linear
    from sangam.models.attention import PagedKV
    from sangam.models.config import fp8_scale_rows

    meta, bf16, i32, i64 = torch.device("meta"), torch.bfloat16, torch.int32, torch.int64
    fp8 = torch.float8_e4m3fn

    def empty(*shape, dtype=bf16):
        return torch.empty(shape, dtype=dtype, device=meta)

    shapes = Shapes.of(quick)
    with cross_compiling(TARGETS[gpu]) as builds:
        for model in models.split(","):
            hq, hkv, d, layers = MODELS[model]
            spans = [(r, kv, STEP_QUERIES) for r in shapes.batches for kv in shapes.kvs]
            spans += [(1, kv, kv) for kv in shapes.refresh]
            if model in CAUSAL_BLOCK:  # its block steps: the finished block and the new one
                spans += [(r, kv, 2 * CAUSAL_BLOCK[model]) for r in shapes.batches
                          for kv in shapes.kvs]
            for r, kv, n_q in spans:
                pages = r * (kv // PAGE)
                kv_buf = empty(layers, 2, pages, PAGE, hkv, d)  # a PagedKV buffer's layout
                q, k = empty(r * n_q, hq, d), empty(r * n_q, hkv, d)
                store_kv(k, k, kv_buf[0, 0], kv_buf[0, 1], empty(r * n_q, dtype=i64))
                causal = ({"causal_blocks": empty(r, dtype=i32),
                           "positions": empty(r * n_q, dtype=i64)}
                          if model in CAUSAL_BLOCK else {})
                paged_attention(q, kv_buf[0, 0], kv_buf[0, 1], empty(r + 1, dtype=i32),
                                empty(r, kv // PAGE, dtype=i32), empty(r, dtype=i32),
                                d ** -0.5, max_query_len=n_q, **causal)
            # The FP8 KV cache (PagedKV's layout: values, then each row's head scale) at the
            # cached steps' and refreshes' spans.
            for r, kv, n_q in spans[::4]:
                pages = r * (kv // PAGE)
                fp8_kv = PagedKV(empty(1, 2, pages, PAGE + fp8_scale_rows(PAGE, d), hkv, d,
                                       dtype=torch.uint8))
                q, k = empty(r * n_q, hq, d), empty(r * n_q, hkv, d)
                store_kv(k, k, fp8_kv.k[0], fp8_kv.v[0], empty(r * n_q, dtype=i64),
                         **fp8_kv.scales(0))
                paged_attention(q, fp8_kv.k[0], fp8_kv.v[0], empty(r + 1, dtype=i32),
                                empty(r, kv // PAGE, dtype=i32), empty(r, dtype=i32),
                                d ** -0.5, max_query_len=n_q, **fp8_kv.scales(0))
            for n_req in shapes.gather:
                pages = n_req * GATHER_TOKENS // PAGE
                kv_buf, ids = empty(layers, 2, pages, PAGE, hkv, d), empty(pages, dtype=i64)
                scatter_pages(gather_pages(kv_buf, ids), kv_buf, ids)
        for hq, hkv, d, _ in GEMMA_LAYERS.values():  # canvas steps and prefill chunks
            for r, kv, n_q in ([(r, kv, GEMMA_CANVAS) for r in shapes.batches
                                for kv in shapes.kvs] + [(1, kv, kv) for kv in shapes.refresh]):
                kv_buf = empty(1, 2, r * (kv // PAGE), PAGE, hkv, d)
                bounds = (empty(r * n_q, dtype=i32), empty(r * n_q, dtype=i32))
                paged_attention(empty(r * n_q, hq, d), kv_buf[0, 0], kv_buf[0, 1],
                                empty(r + 1, dtype=i32), empty(r, kv // PAGE, dtype=i32),
                                empty(r, dtype=i32), 1.0, max_query_len=n_q, key_bounds=bounds)
        for m in shapes.unmask:
            fused_score(empty(m, VOCAB), VOCAB - 128, empty(m, dtype=torch.float64),
                        empty(m, dtype=i64))
        for model in filter(None, moe_models.split(",")):
            moe = MOE_MODELS[model]
            for t in shapes.moe_tokens:
                weights, ids = moe.route(empty(t, moe.experts),
                                         empty(moe.experts, dtype=torch.float32))
                fused_moe(empty(t, moe.hidden), empty(moe.experts, 2 * moe.inter, moe.hidden),
                          empty(moe.experts, moe.hidden, moe.inter), weights, ids,
                          activation=moe.activation)
                blocks = 2 * -(-moe.inter // 128), -(-moe.hidden // 128)
                fused_moe(empty(t, moe.hidden),
                          empty(moe.experts, 2 * moe.inter, moe.hidden, dtype=fp8),
                          empty(moe.experts, moe.hidden, moe.inter, dtype=fp8), weights, ids,
                          activation=moe.activation, block_weights=True,
                          w13_scale=empty(moe.experts, *blocks, dtype=torch.float32),
                          w2_scale=empty(moe.experts, blocks[1], blocks[0] // 2,
                                         dtype=torch.float32))
        for _, n, k in FP8_PROJECTIONS:
            for t in shapes.fp8_tokens:
                fp8_linear(empty(t, k), empty(n, k, dtype=fp8),
                           empty(n // 128, k // 128, dtype=torch.float32), block_weights=True)
    return [dataclasses.asdict(b) | {"constants": {k: str(v) for k, v in b.constants.items()},
                                     "text": b.describe()} for b in builds]


# ----------------------------------------------------------------------------- CPU check

def cpu_selfcheck() -> list[dict]:
    """Every kernel against its reference at tiny shapes (interpreter). Returns result rows."""
    from sangam.decoding import score_logits
    from sangam.kernels import (
        fused_moe,
        fused_moe_ref,
        fused_score,
        gather_pages,
        gather_pages_ref,
        moe_route,
        moe_route_ref,
        paged_attention,
        paged_attention_ref,
        scatter_pages,
        scatter_pages_ref,
        store_kv,
        store_kv_ref,
    )

    g = torch.Generator().manual_seed(0)
    results = []

    def record(name, ok, detail=""):
        results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  {name:<34} {'ok' if ok else 'FAILED'} {detail}", flush=True)

    # Attention: GQA group 7, spans crossing pages, plain and split-KV.
    q = torch.randn(40, 7, 16, generator=g)
    kc = torch.randn(12, 16, 1, 16, generator=g)
    vc = torch.randn(12, 16, 1, 16, generator=g)
    cu = torch.tensor([0, 32, 40], dtype=torch.int32)
    table = torch.tensor([[3, 7, 1, 0, 9], [11, 2, 5, -1, -1]], dtype=torch.int32)
    kv_lens = torch.tensor([70, 40], dtype=torch.int32)
    ref = paged_attention_ref(q, kc, vc, cu, table, kv_lens, 0.25)
    for splits in (1, 3):
        out = paged_attention(q, kc, vc, cu, table, kv_lens, 0.25, num_splits=splits)
        err = (out - ref).abs().max().item()
        record(f"paged_attention splits={splits}", err < 1e-4, f"max err {err:.1e}")

    k = torch.randn(9, 2, 16, generator=g)
    slots = torch.tensor([0, 5, -1, 17, 18, 33, 2, -1, 40])
    pages = [torch.zeros(3, 16, 2, 16) for _ in range(4)]
    store_kv(k, k, pages[0], pages[1], slots)
    store_kv_ref(k, k, pages[2], pages[3], slots)
    record("store_kv", torch.equal(pages[0], pages[2]) and torch.equal(pages[1], pages[3]))

    logits = 3 * torch.randn(11, 300, generator=g)
    args = (torch.tensor([0.0] * 4 + [0.7] * 7, dtype=torch.float64),  # greedy and sampled
            torch.randint(0, 2**32, (11,), generator=g))
    for splits in (1, 3):
        got = fused_score(logits, 299, *args, block_v=64, num_splits=splits)
        want = score_logits(logits, 299, *args)
        record(f"fused_score splits={splits}", torch.equal(got[0], want.tokens)
               and torch.allclose(got[1], want.conf, atol=1e-6))

    pool = torch.randn(3, 2, 6, 4, 2, 8, generator=g)
    ids = torch.tensor([4, 0, 5])
    buf = gather_pages(pool, ids, slice(1, 3))
    record("gather_pages", torch.equal(buf, gather_pages_ref(pool, ids, slice(1, 3))))
    a, b = pool.clone(), pool.clone()
    scatter_pages(buf, a, torch.tensor([1, 2, 3]), slice(1, 3))
    scatter_pages_ref(buf, b, torch.tensor([1, 2, 3]), slice(1, 3))
    record("scatter_pages", torch.equal(a, b))

    # MoE: LLaDA2's grouped sigmoid router and OLMoE's softmax one over 16 experts, then the
    # experts (H 64, I 48) for 37 tokens x 4: runs that end mid-tile, experts with no token.
    logits = torch.randn(37, 16, generator=g)
    routers = {"sigmoid": dict(bias=0.1 * torch.randn(16, generator=g), n_group=4,
                               topk_group=2, scale=2.5), "softmax": {}}
    for score, kw in routers.items():
        got, want = (fn(logits, top_k=4, score=score, **kw) for fn in (moe_route, moe_route_ref))
        record(f"moe_route {score}", torch.equal(got[1], want[1])
               and torch.allclose(got[0], want[0], atol=1e-6))
    w13 = torch.randn(16, 96, 64, generator=g) / 8
    w2 = torch.randn(16, 64, 48, generator=g) / 7
    x = torch.randn(37, 64, generator=g)
    weights, ids = moe_route_ref(logits - 9 * (torch.arange(16) % 3 == 0), top_k=4,
                                 score="sigmoid", **routers["sigmoid"])
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    err = (fused_moe(x, w13, w2, weights, ids) - ref).abs().max().item()
    record("fused_moe", err < 1e-4, f"max err {err:.1e}")

    # FP8: a GEMM with block scales and per-group activations (K not a multiple of 128), and
    # the experts above in FP8 with per-channel scales.
    from sangam.kernels.fp8_gemm import fp8_linear
    from sangam.kernels.reference import fp8_linear_ref

    w = torch.randn(72, 200, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(1, 2, generator=g) + 0.5
    xq = torch.randn(5, 200, generator=g)
    ref = fp8_linear_ref(xq, w, scale, block_weights=True)
    err = (fp8_linear(xq, w, scale, block_weights=True) - ref).abs().max().item()
    record("fp8_linear", err < 1e-3, f"max err {err:.1e}")
    kw = dict(w13_scale=w13.abs().amax(-1) / 448, w2_scale=w2.abs().amax(-1) / 448,
              block_weights=False)
    q13 = (w13 / kw["w13_scale"][..., None]).to(torch.float8_e4m3fn)
    q2 = (w2 / kw["w2_scale"][..., None]).to(torch.float8_e4m3fn)
    ref = fused_moe_ref(x, q13, q2, weights, ids, **kw)
    err = (fused_moe(x, q13, q2, weights, ids, **kw) - ref).abs().max().item()
    record("fused_moe fp8", err < 1e-3, f"max err {err:.1e}")
    return results


def _isolated(function: str, interpret: bool, **kwargs) -> list[dict] | None:
    """``function(**kwargs)`` of this module in a fresh Python with or without the interpreter
    (Triton picks interpreted or compiled kernels at import time). None if it crashed."""
    if interpret == (os.environ.get("TRITON_INTERPRET") == "1"):
        return globals()[function](**kwargs)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        code = ("import json, sys; from sangam.bench import kernels; "
                f"json.dump(kernels.{function}(**{kwargs!r}), open(sys.argv[1], 'w'))")
        proc = subprocess.run([sys.executable, "-c", code, out], env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            return None
        with open(out) as f:
            return json.load(f)


def _run_cpu(args: argparse.Namespace) -> int:
    print("No CUDA GPU: kernel timings need one. Instead: a correctness pass of every kernel at "
          "tiny shapes under the Triton interpreter, then every serving-shape launch compiled "
          f"for the {args.gpu} (registers, spills, shared memory).")
    checks = _isolated("cpu_selfcheck", interpret=True)
    if checks is None:
        checks = [{"check": "interpreter run", "ok": False, "detail": "crashed"}]
    ok = all(r["ok"] for r in checks)
    print("all kernels match their references" if ok else "SOME KERNELS DISAGREE")
    print(f"\nCompiling for the {args.gpu} (no GPU needed; Triton's ptxas):")
    builds = _isolated("cross_compile_builds", interpret=False, gpu=args.gpu,
                       models=args.models, quick=args.quick, moe_models=args.moe_models)
    if builds is None:
        print("CROSS-COMPILE FAILED (see the error above)")
    else:
        # Builds that differ only in argument specialization (alignment, ints equal to 1)
        # print once.
        for text, count in collections.Counter(b["text"] for b in builds).items():
            print(f"  {text}" + (f"  ({count} specializations)" if count > 1 else ""))
        spilled = [b["kernel"] for b in builds if b["spill_bytes"]]
        print(f"{len(builds)} builds; " + (f"SPILLS in {', '.join(sorted(set(spilled)))}"
                                            if spilled else "no register spills"))
    if args.json:
        _write_json(args.json, {"gpu": None, "cpu_selfcheck": checks,
                                "cross_compile": {"gpu": args.gpu, "builds": builds}})
        print(f"wrote {args.json}")
    return 0


def _write_json(path: str, payload: dict) -> None:
    import triton

    payload = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__,
        "peak": {"bytes_per_s": PEAK_BYTES_PER_S, "flops": PEAK_FLOPS}, **payload,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return _run_cpu(args)
    torch.manual_seed(0)

    def save(rows: list[dict]) -> None:
        if args.json:
            _write_json(args.json, {"gpu": torch.cuda.get_device_name(), "results": rows})

    run_gpu(args, save)
    return 0


def register(sub) -> None:
    p = sub.add_parser("kernels", help="Triton kernel timings at LLaDA-8B / Dream-7B shapes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suites", default=",".join(SUITES),
                   help=f"comma-separated subset of {','.join(SUITES)}")
    p.add_argument("--models", default="llada,dream,sdar", help="comma-separated subset of "
                   f"{','.join(MODELS)}")
    p.add_argument("--moe-models", default=",".join(MOE_MODELS), help="the moe suite's "
                   f"expert shapes: comma-separated subset of {','.join(MOE_MODELS)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=50, help="do_bench measuring time, ms")
    p.add_argument("--gpu", default="H200", help="without a GPU: the GPU to compile every "
                   "launch for (H200, H100, A100)")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=run)
