"""Mixture-of-experts FFN: the router's grouped top-k and the experts' gated MLPs (SwiGLU, or
Gemma's GeGLU), fused.

Routing (:func:`moe_route`) is one small kernel, one program per token: the scores (sigmoid plus
the selection bias, or softmax), the expert groups' top-2 sums, the kept groups and the top-k
experts, with ties to the lower index, as :func:`sangam.kernels.reference.moe_route_ref`.

The experts (:func:`fused_moe`) run as two grouped GEMMs over the (token, k) pairs sorted by
expert. The sort pads every expert's run of pairs to a multiple of BLOCK_M, so each BLOCK_M tile
of rows belongs to one expert (an expert with no pairs gets no tile) and a program streams just
that expert's weights. Nothing on the host reads the routing: the engine captures forwards in
CUDA graphs, so the padded buffers and the grid are sized by the data-independent bound of
T*K + min(E, T*K) * (BLOCK_M - 1) rows, and programs whose tile lies past the real padded total
exit at once.

  1. gate+up: each program computes a [BLOCK_M, BLOCK_N] tile of gate and the matching tile of
     up for its expert's rows and writes act(gate) * up, in x's dtype, to an intermediate
     ``[rows, I]`` (the sorted, padded order);
  2. down: each program multiplies its rows of the intermediate by the expert's down
     projection, scales each row by its routing weight and writes it to the row of its
     (token, k) pair in a ``[T, K, H]`` buffer (fp32; fp64 for fp64);
  3. combine: each token's K rows summed in the fixed order k = 0..K-1.

No float atomics anywhere: a token's result is the same whatever other tokens share the batch
(for one launch configuration, which depends only on the batch's size), and runs repeat
bitwise. GEMMs accumulate in fp32 (fp64 for fp64 inputs) on ``tl.dot``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sangam.kernels.fp8_gemm import quantize_rows
from sangam.kernels.platform import compiled, max_shared_bytes
from sangam.kernels.reference import (
    FP8_GROUP,
    MOE_ACTIVATIONS,
    check_route_args,
)

# ----------------------------------------------------------------------------- routing


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    group_size, num_groups, s_logits, s_w, s_ids,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
    SCALE: tl.constexpr, CDT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # The experts as a [group, expert-in-group] grid: no reshape, any group size.
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    expert = g[:, None] * group_size + j[None, :]
    ok = (g < num_groups)[:, None] & (j < group_size)[None, :]
    x = tl.load(logits_ptr + t * s_logits + expert, mask=ok, other=0.0).to(CDT)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
        c = s
        if HAS_BIAS:
            c = s + tl.load(bias_ptr + expert, mask=ok, other=0.0).to(CDT)
    else:
        x = tl.where(ok, x, float("-inf"))
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        s = p / tl.sum(tl.sum(p, 1), 0)
        c = s
    c = tl.where(ok, c, float("-inf"))
    if GROUPED:
        # A group's score: its best c plus its second best (the best once more excluded by
        # index, so equal values count twice); a one-expert group's is its one c.
        top1 = tl.max(c, 1)
        first = tl.min(tl.where(c == top1[:, None], j[None, :], BLOCK_EG), 1)
        top2 = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), c), 1)
        score = tl.where(group_size > 1, top1 + top2, top1)
        score = tl.where(g < num_groups, score, float("-inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(score, 0)
            pick = tl.min(tl.where(score == best, g, BLOCK_G), 0)
            keep = keep | (g == pick)
            score = tl.where(g == pick, float("-inf"), score)
        c = tl.where(keep[:, None], c, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], CDT)
    ids = tl.zeros([BLOCK_K], tl.int32)
    num_experts = num_groups * group_size
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(c, 1), 0)
        pick = tl.min(tl.min(tl.where(c == best, expert, num_experts), 1), 0)
        chosen = expert == pick
        weights = tl.where(slot == i, tl.sum(tl.sum(tl.where(chosen, s, 0.0), 1), 0), weights)
        ids = tl.where(slot == i, pick, ids)
        c = tl.where(chosen, float("-inf"), c)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    weights = weights * SCALE
    tl.store(weights_ptr + t * s_w + slot, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + t * s_ids + slot, ids, mask=slot < TOP_K)


def moe_route(logits: torch.Tensor, *, top_k: int, score: str, bias: torch.Tensor | None = None,
              n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
              scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for logits ``[T, E]``: (weights ``[T, top_k]`` fp32, fp64 for fp64
    logits; ids ``[T, top_k]`` int32), as :func:`sangam.kernels.reference.moe_route_ref` with
    the same arguments (ids in descending score order, ties to the lower index)."""
    num_tokens, num_experts = logits.shape
    check_route_args(num_experts, top_k=top_k, score=score, bias=bias, n_group=n_group,
                     topk_group=topk_group)
    dev = logits.device
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    weights = torch.empty(num_tokens, top_k, dtype=cdt, device=dev)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=dev)
    if num_tokens == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    group_size = num_experts // n_group
    block = triton.next_power_of_2(n_group) * triton.next_power_of_2(group_size)
    _route_kernel[(num_tokens,)](
        logits, logits if bias is None else bias.contiguous(), weights, ids,
        group_size, n_group, logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, TOPK_GROUP=topk_group, BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_EG=triton.next_power_of_2(group_size), BLOCK_K=triton.next_power_of_2(top_k),
        SIGMOID=score == "sigmoid", HAS_BIAS=bias is not None, GROUPED=topk_group < n_group,
        RENORMALIZE=renormalize, SCALE=float(scale),
        CDT=tl.float64 if cdt == torch.float64 else tl.float32,
        # A warp holds 256 scores in registers: the reductions stay within it.
        num_warps=1 if block <= 256 or not compiled(dev) else 2,
    )
    return weights, ids


# ----------------------------------------------------------------------------- experts



@triton.jit(do_not_specialize=["num_pairs"])  # per batch: no variant per token count
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, ws_ptr,
    num_pairs, num_experts, hidden, inter, top_k,
    s_x, s_we, s_wn, s_out, s_wse, s_wsn, up_block,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    ACC_DTYPE: tl.constexpr, GELU_TANH: tl.constexpr, FP8: tl.constexpr,
    W_BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < num_experts:  # past the padded total: nothing to do
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        row_ok = pair < num_pairs  # padding rows hold num_pairs
        token = (pair // top_k).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < inter
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * s_x + offs_k[None, :]
        g_ptrs = w_ptr + e.to(tl.int64) * s_we + offs_n[:, None] * s_wn + offs_k[None, :]
        u_ptrs = g_ptrs + inter * s_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], ACC_DTYPE)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], ACC_DTYPE)
        for k0 in range(0, hidden, BLOCK_K):
            if EVEN_K:  # the masks stay constant along k: 16-byte loads
                a_mask = row_ok[:, None]
                w_mask = n_ok[:, None]
            else:
                k_ok = offs_k < hidden - k0
                a_mask = row_ok[:, None] & k_ok[None, :]
                w_mask = n_ok[:, None] & k_ok[None, :]
            if FP8:  # BLOCK_K is the activations' group: this tile's scale per row
                aq, a_s = quantize_rows(tl.load(a_ptrs, mask=a_mask, other=0.0))
                wg = tl.load(g_ptrs, mask=w_mask, other=0.0)
                wu = tl.load(u_ptrs, mask=w_mask, other=0.0)
                part_g = tl.dot(aq, tl.trans(wg)) * a_s[:, None]
                part_u = tl.dot(aq, tl.trans(wu)) * a_s[:, None]
                if W_BLOCK:
                    ws = ws_ptr + e.to(tl.int64) * s_wse + k0 // BLOCK_K
                    part_g *= tl.load(ws + (offs_n // BLOCK_K) * s_wsn, mask=n_ok)[None, :]
                    part_u *= tl.load(ws + (up_block + offs_n // BLOCK_K) * s_wsn,
                                      mask=n_ok)[None, :]
                acc_g += part_g
                acc_u += part_u
            else:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
                wg = tl.load(g_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
                wu = tl.load(u_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
                # out_dtype: Triton 3.6 checks the accumulator against it (fp32 by default).
                acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=DOT_PREC,
                               out_dtype=ACC_DTYPE)
                acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=DOT_PREC,
                               out_dtype=ACC_DTYPE)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if FP8 and not W_BLOCK:  # one scale per output channel: gate rows, then up rows
            ws = ws_ptr + e.to(tl.int64) * s_wse
            acc_g *= tl.load(ws + offs_n, mask=n_ok)[None, :]
            acc_u *= tl.load(ws + inter + offs_n, mask=n_ok)[None, :]
        if GELU_TANH:  # gelu(g) = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3)): tanh's form
            inner = 1.5957691216057308 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)
            h = acc_g / (1.0 + tl.exp(-inner)) * acc_u
        else:
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up
        out = out_ptr + offs_m.to(tl.int64)[:, None] * s_out + offs_n[None, :]
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr, w_ptr, out_ptr, pairs_ptr, tile_expert_ptr, topk_w_ptr, ws_ptr,
    num_pairs, num_experts, hidden, inter,
    s_h, s_we, s_wn, s_out, s_wse, s_wsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    ACC_DTYPE: tl.constexpr, FP8: tl.constexpr, W_BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile)
    if e < num_experts:
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + offs_m)
        row_ok = pair < num_pairs
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hidden
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * s_h + offs_k[None, :]
        b_ptrs = w_ptr + e.to(tl.int64) * s_we + offs_n[:, None] * s_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], ACC_DTYPE)
        for k0 in range(0, inter, BLOCK_K):
            if EVEN_K:
                a_mask = row_ok[:, None]
                b_mask = n_ok[:, None]
            else:
                k_ok = offs_k < inter - k0
                a_mask = row_ok[:, None] & k_ok[None, :]
                b_mask = n_ok[:, None] & k_ok[None, :]
            if FP8:
                aq, a_s = quantize_rows(tl.load(a_ptrs, mask=a_mask, other=0.0))
                b = tl.load(b_ptrs, mask=b_mask, other=0.0)
                part = tl.dot(aq, tl.trans(b)) * a_s[:, None]
                if W_BLOCK:
                    ws = ws_ptr + e.to(tl.int64) * s_wse + (offs_n // BLOCK_K) * s_wsn
                    part *= tl.load(ws + k0 // BLOCK_K, mask=n_ok)[None, :]
                acc += part
            else:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
                b = tl.load(b_ptrs, mask=b_mask, other=0.0).to(DOT_DTYPE)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC,
                             out_dtype=ACC_DTYPE)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if FP8 and not W_BLOCK:
            acc *= tl.load(ws_ptr + e.to(tl.int64) * s_wse + offs_n, mask=n_ok)[None, :]
        weight = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(ACC_DTYPE)
        acc = acc * weight[:, None]
        out = out_ptr + pair.to(tl.int64)[:, None] * s_out + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(
    part_ptr, out_ptr, hidden, s_part, s_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros([BLOCK_H], ACC_DTYPE)
    for k in tl.static_range(TOP_K):  # k = 0..K-1, always in this order
        acc += tl.load(part_ptr + (t * TOP_K + k) * s_part + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * s_out + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class _Gemm:
    """One grouped GEMM's launch: tile widths (N over outputs, K over the reduction), warps,
    pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_SHARED_SLACK = 8 * 1024  # what the compiler may add for layout changes


def _fit(gemm: _Gemm, block_m: int, operands: int, elem_bytes: int, budget: int) -> _Gemm:
    """``gemm`` with fewer stages, then a narrower K tile, until its shared memory (each stage
    holds the rows' tile and ``operands`` weight tiles) fits ``budget``. The H200's and the
    A100's 227 and 163 KiB hold every tile chosen here as is; chips with less need this."""
    n, k, stages = gemm.block_n, gemm.block_k, gemm.num_stages
    while (stages * (block_m + operands * n) * k * elem_bytes + _SHARED_SLACK > budget
           and (stages > 2 or k > 16)):
        if stages > 2:
            stages -= 1
        else:
            k //= 2
    return _Gemm(n, k, gemm.num_warps, stages)


def _pow2_within(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def moe_block_m(num_pairs: int, num_experts: int, on_gpu: bool) -> int:
    """Rows per tile, from the mean number of (token, k) pairs per expert: 16 for decode-sized
    batches (LLaDA2's 64 tokens x 8 over 256 experts: 2 each, so the tiles are mostly padding
    and the weights' bytes are the cost), up to 64 for prefills (2048 tokens: 64 each). A tile
    pads each expert's rows by BLOCK_M - 1 at most. The interpreter's cost is per program and
    op: 16 there."""
    if not on_gpu:
        return 16
    return _pow2_within(-(-num_pairs // num_experts), 16, 64)


def _gemm_configs(block_m: int, hidden: int, inter: int, elem_bytes: int,
                  device: torch.device) -> tuple[_Gemm, _Gemm]:
    """(gate+up, down) launches. GPU: BLOCK_K of 128 half-precision elements for the
    memory-bound decode tiles (long 16-byte bursts of each weight row), 64 with 8 warps for
    prefill tiles, whose gate and up accumulators of 64 x 128 fp32 then take 64 registers a
    thread. Interpreter: tiles as wide as the (tiny) matrices, one warp, one stage; the K tile
    depends on the shapes only, never on the batch, so a token's sums are the same in any
    batch."""
    if not compiled(device):
        return (_Gemm(_pow2_within(inter, 16, 64), _pow2_within(hidden, 16, 64), 1, 1),
                _Gemm(_pow2_within(hidden, 16, 64), _pow2_within(inter, 16, 64), 1, 1))
    if block_m <= 16:
        gate_up, down = _Gemm(64, 128, 4, 4), _Gemm(64, 128, 4, 4)
    elif block_m <= 32:
        gate_up, down = _Gemm(64, 128, 4, 3), _Gemm(128, 64, 4, 4)
    else:
        gate_up, down = _Gemm(128, 64, 8, 3), _Gemm(128, 64, 8, 3)
    if elem_bytes > 2:
        # fp32 dots (IEEE, no TF32) run on the FMA units with their operands in registers, fp64
        # ones on the DMMA units: thinner tiles for both. The exact-test dtypes, not the served.
        wide = _Gemm(64, 16 if elem_bytes == 4 else 32, 8 if block_m > 16 else 4, 2)
        gate_up = down = wide
    budget = max_shared_bytes(device)
    return (_fit(gate_up, block_m, 2, elem_bytes, budget),
            _fit(down, block_m, 1, elem_bytes, budget))


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs sorted by expert (stable: by pair index within an expert), each
    expert's run padded to a multiple of ``block_m``: (pairs int32 ``[tiles * block_m]``, the
    pair index ``t * K + k`` of each row, ``T * K`` for padding; tile_expert int32 ``[tiles]``,
    each tile's expert, ``num_experts`` for tiles past the padded total). Pairs whose id is
    ``num_experts`` (an expert another rank holds) get no row. Shapes depend on T, K, E and
    block_m only, and nothing is read back to the host."""
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    num_tiles = triton.cdiv(rows, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)
    expert_of, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=dev)
    ends = torch.searchsorted(expert_of, experts, right=True)  # each expert's end, sorted
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    # The i-th sorted pair moves from its expert's start to its expert's padded start.
    shift = (padded_ends - padded) - (ends - counts)
    # Pairs of experts held elsewhere (sorted last) land in one slot past the end, cut off.
    dump = num_tiles * block_m
    shift = torch.cat([shift, shift.new_full((1,), dump)])
    rows_of = torch.minimum(torch.arange(num_pairs, device=dev) + shift[expert_of],
                            torch.tensor(dump, device=dev))
    pairs = torch.full((dump + 1,), num_pairs, dtype=torch.int32, device=dev)
    pairs.scatter_(0, rows_of, order.to(torch.int32))
    pairs = pairs[:dump]
    tile_start = torch.arange(num_tiles, device=dev) * block_m
    tile_expert = torch.searchsorted(padded_ends, tile_start, right=True).to(torch.int32)
    return pairs, tile_expert


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, block_m: int | None = None,
              partial: bool = False, activation: str = "silu",
              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_weights: bool = False) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in x's dtype, as
    :func:`sangam.kernels.reference.fused_moe_ref`: x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows,
    then up rows); w2 ``[E, H, I]``; topk_weights ``[T, K]`` (any float dtype) and topk_ids
    ``[T, K]`` (int, each row's experts distinct). ``block_m`` (a power of two >= 16) forces
    the rows per tile. ``partial`` (expert parallelism): ids equal to ``E`` name experts other
    ranks hold, which contribute nothing here. ``activation``: the gate's, one of
    ``MOE_ACTIVATIONS``. FP8 experts (float8_e4m3fn w13/w2 with their scales, laid out as
    :func:`sangam.kernels.reference.dequantize_fp8_experts` reads them): both GEMMs quantize
    their input rows per group of 128 in the prologue, K tiles of 128. No host sync: safe
    inside CUDA-graph capture."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"expert activation must be one of {MOE_ACTIVATIONS}, got "
                         f"{activation!r}")
    num_tokens, hidden = x.shape
    num_experts, two_i, w13_h = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else -1
    if (w13_h != hidden or two_i % 2 or tuple(w2.shape) != (num_experts, hidden, inter)
            or topk_ids.shape[0] != num_tokens or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 "
                         f"{tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}")
    dev = x.device
    out = torch.empty_like(x)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the expert weights' last dim must be contiguous")
    on_gpu = compiled(dev)
    num_pairs = num_tokens * top_k
    bm = block_m or moe_block_m(num_pairs, num_experts, on_gpu)
    gate_up, down = _gemm_configs(bm, hidden, inter, x.element_size(), dev)
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        if w13_scale is None or w2_scale is None or w2.dtype != w13.dtype:
            raise ValueError("FP8 experts need w13_scale and w2_scale, and FP8 w2")
        # A K tile is one group of the activations' scales (and one weight block).
        gate_up = _Gemm(gate_up.block_n, FP8_GROUP, gate_up.num_warps, gate_up.num_stages)
        down = _Gemm(down.block_n, FP8_GROUP, down.num_warps, down.num_stages)
        ws13, ws2 = w13_scale.float().contiguous(), w2_scale.float().contiguous()
    else:
        ws13 = ws2 = w13
    s13 = (ws13.stride(0), ws13.stride(1) if fp8 and block_weights else 0)
    s2 = (ws2.stride(0), ws2.stride(1) if fp8 and block_weights else 0)
    up_block = ws13.shape[1] // 2 if fp8 and block_weights else 0
    pairs, tile_expert = moe_align(topk_ids, num_experts, bm)
    num_tiles = tile_expert.numel()

    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc_dtype = tl.float64 if acc == torch.float64 else tl.float32
    if x.dtype == torch.float64:
        dot_dtype = tl.float64
    elif on_gpu and x.dtype in (torch.bfloat16, torch.float16):
        dot_dtype = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    else:  # fp32, or half types in the interpreter, whose bf16 dot is wrong
        dot_dtype = tl.float32
    # fp32/fp64 dots in full precision (no TF32); half types use the tensor cores as is.
    prec = "ieee" if dot_dtype in (tl.float32, tl.float64) else "tf32"

    h = torch.empty(num_tiles * bm, inter, dtype=x.dtype, device=dev)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, gate_up.block_n))](
        x, w13, h, pairs, tile_expert, ws13,
        num_pairs, num_experts, hidden, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), *s13, up_block,
        BLOCK_M=bm, BLOCK_N=gate_up.block_n, BLOCK_K=gate_up.block_k,
        EVEN_K=hidden % gate_up.block_k == 0, DOT_DTYPE=dot_dtype, DOT_PREC=prec,
        ACC_DTYPE=acc_dtype, GELU_TANH=activation == "gelu_tanh", FP8=fp8,
        W_BLOCK=fp8 and block_weights, num_warps=gate_up.num_warps,
        num_stages=gate_up.num_stages,
    )
    # [T, K, H]; the rows of experts held elsewhere are never written: zeros for them.
    part = (torch.zeros if partial else torch.empty)(num_pairs, hidden, dtype=acc, device=dev)
    _down_kernel[(num_tiles, triton.cdiv(hidden, down.block_n))](
        h, w2, part, pairs, tile_expert, topk_weights.contiguous(), ws2,
        num_pairs, num_experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), part.stride(0), *s2,
        BLOCK_M=bm, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        EVEN_K=inter % down.block_k == 0, DOT_DTYPE=dot_dtype, DOT_PREC=prec,
        ACC_DTYPE=acc_dtype, FP8=fp8, W_BLOCK=fp8 and block_weights,
        num_warps=down.num_warps, num_stages=down.num_stages,
    )
    block_h = _pow2_within(hidden, 16, 1024 if on_gpu else 256)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        part, out, hidden, part.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, ACC_DTYPE=acc_dtype, num_warps=4 if on_gpu else 1,
    )
    return out
