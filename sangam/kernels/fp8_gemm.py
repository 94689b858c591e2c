"""FP8 linear layers: ``y = x W^T`` with W in float8_e4m3fn and its scales, x quantized to FP8
in the GEMM's prologue (docs/design.md §5.6).

One kernel covers the formats Sangam loads (``sangam.models.quantization``):

- weight scales per output channel (a per-tensor scale is expanded to one), applied once in
  the epilogue; or per 128 x 128 block (DeepSeek-V3's ``weight_scale_inv``), applied to each
  K tile's partial product;
- activations quantized dynamically per token and group of 128 input features (the tile's
  own amax: the K tile is the group, so nothing is read twice), or with a checkpoint's static
  per-tensor ``input_scale``, or not at all (weight-only FP8: W is widened to x's type).

Each K tile is one ``tl.dot`` on FP8 operands (``wgmma`` on sm_90) accumulated in fp32 after
its scales. The reference, :func:`sangam.kernels.reference.fp8_linear_ref`, quantizes the
same groups the same way, so both see the same FP8 values and differ only in accumulation
order. Group boundaries count from a rank's first input feature: under tensor parallelism a
row-parallel cut at a multiple of 128 quantizes exactly as the whole model does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sangam.kernels.platform import compiled
from sangam.kernels.reference import FP8_ACTIVATIONS, FP8_AMAX_FLOOR, FP8_GROUP, FP8_MAX


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` (|x| <= FP8_MAX) rounded to the nearest e4m3 value, ties to even, still in
    fp32: the conversion that follows is then exact on any backend (the interpreter's own
    fp32 -> fp8 cast truncates; the GPU's rounds to nearest even, as this does)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 mantissa bits, rounding at bit 20 (a carry may bump the exponent).
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal: multiples of 2^-9 (fp32 adds round to nearest even).
    magic = 12582912.0  # 1.5 * 2^23: x * 512 + magic rounds x * 512 to an integer
    sub = ((x * 512.0 + magic) - magic) / 512.0
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


_FMAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def scaled_to_e4m3(xf, s):
    """fp32 rows ``xf`` divided by their scales ``s`` as FP8, the reference's values (IEEE
    division, nearest-even rounding)."""
    return round_to_e4m3(tl.clamp(tl.math.div_rn(xf, s[:, None]), -_FMAX, _FMAX)).to(
        tl.float8e4nv)


@triton.jit
def quantize_rows(x):
    """A tile's rows as FP8 with one scale per row (its amax / FP8_MAX): (values, scales), as
    ``quantize_fp8_groups_ref`` and ``quantize_kv_ref`` make them. The GEMM's, the experts'
    and the FP8 KV store's prologue."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), axis=1), _AMAX_FLOOR)
    s = tl.math.div_rn(amax, tl.full(amax.shape, _FMAX, tl.float32))
    return scaled_to_e4m3(xf, s), s


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, ws_ptr, xs_ptr, out_ptr,
    M, N, K, s_x, s_w, s_ws, s_ws_n, s_out,
    ACT: tl.constexpr, W_BLOCK: tl.constexpr, GROUP: tl.constexpr,
    WIDE: tl.constexpr, WIDE_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, GROUP)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * s_x
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * s_w
    if ACT == 2:  # the checkpoint's static per-tensor activation scale
        x_scale = tl.load(xs_ptr).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, GROUP):
        k_ok = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # W tile as [GROUP, BLOCK_N]: column n is output channel n's weights over this group.
        w = tl.load(w_cols + (k0 + rk)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if ACT == 0:  # weight-only: W widened to x's type (exact: e4m3 fits bf16 and fp32)
            part = tl.dot(x.to(WIDE), w.to(WIDE), input_precision=WIDE_PREC)
        else:
            if ACT == 1:  # dynamic: this group's amax per token
                xq, s = quantize_rows(x)
            else:
                s = tl.zeros((BLOCK_M,), dtype=tl.float32) + x_scale
                xq = scaled_to_e4m3(x.to(tl.float32), s)
            part = tl.dot(xq, w)
            if ACT == 1:
                part = part * s[:, None]
        if W_BLOCK:  # this K tile's block scale of each output channel
            ws = tl.load(ws_ptr + (rn // GROUP) * s_ws + k0 // GROUP, mask=n_ok, other=0.0)
            part = part * ws[None, :]
        acc += part
    if not W_BLOCK:
        acc = acc * tl.load(ws_ptr + rn * s_ws_n, mask=n_ok, other=0.0)[None, :]
    if ACT == 2:
        acc = acc * x_scale
    out = out_ptr + rm.to(tl.int64)[:, None] * s_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _tiles(rows: int, on_gpu: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps). GPU: 16-row tiles for decode-sized batches (the weights'
    bytes are the cost: mma.sync), 64 x 128 over two warpgroups (wgmma) beyond.
    Interpreter: small tiles, one warp (its cost is per op)."""
    if not on_gpu:
        return 16, 32, 1
    if rows <= 16:
        return 16, 64, 4
    return 64, 128, 8


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
               activation: str = "dynamic", input_scale: torch.Tensor | None = None,
               block_weights: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K])^T (+ bias)`` in x's dtype, as
    :func:`sangam.kernels.reference.fp8_linear_ref`. ``weight``: float8_e4m3fn;
    ``weight_scale``: fp32 ``[N]`` (per channel) or, with ``block_weights``, ``[ceil(N/128),
    ceil(K/128)]``. ``activation``: one of ``FP8_ACTIVATIONS`` (``static`` reads
    ``input_scale``, one fp32 value). No host sync: safe inside CUDA-graph capture."""
    if activation not in FP8_ACTIVATIONS:
        raise ValueError(f"activation must be one of {FP8_ACTIVATIONS}, got {activation!r}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError("weight must be a row-major [N, K] float8_e4m3fn matrix")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    if activation == "static" and (input_scale is None or input_scale.numel() != 1):
        raise ValueError("static activation quantization needs a one-value input_scale")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        on_gpu = compiled(x.device)
        bm, bn, warps = _tiles(m, on_gpu)
        # Per channel: any stride (a per-tensor scale expanded reads one value, not a copy).
        ws = weight_scale.to(torch.float32)
        if block_weights:
            ws = ws.contiguous()
        if x.dtype == torch.bfloat16 and on_gpu:
            wide, prec = tl.bfloat16, "tf32"
        elif x.dtype == torch.float16 and on_gpu:
            wide, prec = tl.float16, "tf32"
        else:  # fp32 (the interpreter's half-precision dot is wrong): IEEE, no TF32
            wide, prec = tl.float32, "ieee"
            if x2.dtype != torch.float32:
                x2 = x2.to(torch.float32)
        xs = input_scale if input_scale is not None else ws
        res = out if out.dtype == x2.dtype else torch.empty(m, n, dtype=x2.dtype,
                                                            device=x.device)
        _fp8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, weight, ws, xs, res, m, n, k, x2.stride(0), weight.stride(0),
            ws.stride(0) if block_weights else 0, 0 if block_weights else ws.stride(0),
            res.stride(0),
            ACT=FP8_ACTIVATIONS.index(activation), W_BLOCK=block_weights, GROUP=FP8_GROUP,
            WIDE=wide, WIDE_PREC=prec,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=3 if on_gpu else 1,
        )
        if res is not out:
            out.copy_(res)
    else:
        out.zero_()
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*lead, n)
