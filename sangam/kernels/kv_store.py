"""KV store: write a span's fresh K/V rows into their page slots (docs/design.md §5.2).

``store_kv`` takes K with RoPE applied; ``store_kv_rope`` takes K before RoPE and rotates it on
the way (rotate-half / NeoX convention, as ``sangam.models.transformer.RotaryEmbedding``), saving
the rotated K's round trip through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sangam.kernels.fp8_gemm import quantize_rows
from sangam.kernels.platform import compiled


@triton.jit(do_not_specialize=["num_rows"])  # per batch: no variant per token count
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, cos_ptr, sin_ptr,
    num_rows, s_k_n, s_k_h, s_v_n, s_v_h,
    s_kc_page, s_kc_off, s_kc_h, s_vc_page, s_vc_off, s_vc_h, s_cos, s_sin,
    row_numel, page_size,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ROPE: tl.constexpr, CDT: tl.constexpr,
):
    # A tile is BLOCK_T rows x (all heads * head_dim) elements, flattened on the second axis.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    e = tl.arange(0, BLOCK_E)
    h = (e // HEAD_DIM)[None, :]
    d = (e % HEAD_DIM)[None, :]
    mask = (slot >= 0)[:, None] & (e < row_numel)[None, :]
    r = rows.to(tl.int64)[:, None]
    k = tl.load(k_ptr + r * s_k_n + h * s_k_h + d, mask=mask)
    if ROPE:
        # k*cos + rotate_half(k)*sin, rotate_half(k) = [-k2, k1], in the compute dtype.
        pos = tl.load(pos_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64)[:, None]
        cos = tl.load(cos_ptr + pos * s_cos + d, mask=mask).to(CDT)
        sin = tl.load(sin_ptr + pos * s_sin + d, mask=mask).to(CDT)
        partner = tl.load(k_ptr + r * s_k_n + h * s_k_h + (d + HEAD_DIM // 2) % HEAD_DIM, mask=mask)
        rot = tl.where(d < HEAD_DIM // 2, -partner.to(CDT), partner.to(CDT))
        k = k.to(CDT) * cos + rot * sin
    v = tl.load(v_ptr + r * s_v_n + h * s_v_h + d, mask=mask)
    kc_row = (page * s_kc_page + off * s_kc_off)[:, None]
    vc_row = (page * s_vc_page + off * s_vc_off)[:, None]
    tl.store(kc_ptr + kc_row + h * s_kc_h + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + vc_row + h * s_vc_h + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _store_kv_fp8_kernel(
    x_ptr, c_ptr, sc_ptr, slot_ptr, num_rows, s_x_n, s_x_h,
    s_c_page, s_c_off, s_c_h, s_sc_page, s_sc_off, s_sc_h, page_size,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    # A tile is BLOCK_T rows of one head (program_id 1): each row's head its own scale.
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    page = slot // page_size
    off = slot % page_size
    d = tl.arange(0, HEAD_DIM)
    ok = slot >= 0
    q, scale = quantize_rows(tl.load(x_ptr + rows.to(tl.int64)[:, None] * s_x_n + h * s_x_h
                                     + d[None, :], mask=ok[:, None], other=0.0))
    row = (page * s_c_page + off * s_c_off + h * s_c_h)[:, None]
    tl.store(c_ptr + row + d[None, :], q, mask=ok[:, None])
    tl.store(sc_ptr + page * s_sc_page + off * s_sc_off + h * s_sc_h, scale, mask=ok)


def _store_fp8(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor,
               slot_mapping: torch.Tensor) -> None:
    """Rows of ``x [N, Hkv, D]`` into an FP8 cache, each row's head with its scale."""
    n, hkv, d = x.shape
    if scales is None or scales.shape != cache.shape[:3]:
        raise ValueError("an FP8 cache needs its scales [num_pages, page_size, Hkv]")
    if x.stride(2) != 1:
        x = x.contiguous()
    # GPU: ~2K elements a program (one head's rows: a row's amax is a reduction over D).
    block_t = max(1, min(triton.next_power_of_2(n), (2048 if compiled(x.device) else 1 << 16)
                         // d))
    _store_kv_fp8_kernel[(triton.cdiv(n, block_t), hkv)](
        x, cache, scales, slot_mapping.contiguous(), n, x.stride(0), x.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        scales.stride(0), scales.stride(1), scales.stride(2), cache.shape[1],
        HEAD_DIM=d, BLOCK_T=block_t, num_warps=4,
    )


def _launch(k, v, k_cache, v_cache, slot_mapping, rope) -> None:
    if k_cache.dtype == torch.float8_e4m3fn:  # values without their scales would be garbage
        raise ValueError("FP8 caches take store_kv with their scales (store_kv_rope has no "
                         "FP8 form)")
    n, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if n == 0:
        return
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    if rope is None:
        pos = cos = sin = slot_mapping  # unused
        s_cos = s_sin = 0
        cdt = tl.float32
    else:
        pos, cos, sin = rope
        s_cos, s_sin = cos.stride(0), sin.stride(0)
        cdt = tl.float64 if k.dtype == torch.float64 else tl.float32
    block_e = triton.next_power_of_2(hkv * d)
    # Interpreter: one program for the whole span (its cost is per program). GPU: ~4K elements
    # per program, so a long refresh still spreads over many SMs.
    target = 4096 if compiled(k.device) else 1 << 16
    block_t = max(1, min(triton.next_power_of_2(n), target // block_e))
    _store_kv_kernel[(triton.cdiv(n, block_t),)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(), pos, cos, sin,
        n, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), s_cos, s_sin,
        hkv * d, k_cache.shape[1],
        HEAD_DIM=d, BLOCK_T=block_t, BLOCK_E=block_e, ROPE=rope is not None, CDT=cdt,
        num_warps=4,
    )


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    """Write row i of k/v ``[N, Hkv, D]`` to flat slot ``slot_mapping[i]`` (int64, page *
    page_size + offset; -1 = skip) of ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]``.

    Caches may be strided views (e.g. one layer of a ``PagedKV`` buffer); the head dim must be
    contiguous everywhere. Slots must be distinct. FP8 caches (float8_e4m3fn) take each row's
    head scaled by its amax / 448 and its scale into ``k_scales``/``v_scales [num_pages,
    page_size, Hkv]``, as :func:`sangam.kernels.reference.store_kv_ref`.
    """
    if k_cache.dtype == torch.float8_e4m3fn:
        if v.shape != k.shape or k_cache.shape[2:] != k.shape[1:] or v_cache.shape != k_cache.shape:
            raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"k_cache {tuple(k_cache.shape)}")
        if k.shape[0]:
            _store_fp8(k, k_cache, k_scales, slot_mapping)
            _store_fp8(v, v_cache, v_scales, slot_mapping)
        return
    _launch(k, v, k_cache, v_cache, slot_mapping, None)


def store_kv_rope(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> None:
    """:func:`store_kv` for K *before* RoPE: row i is rotated for position ``positions[i]``
    with the tables ``cos``/``sin [max_pos, D]`` (rotate-half layout: both halves of a row hold
    the same frequencies), in fp32 (fp64 for fp64 K), then stored in the cache dtype."""
    if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.shape[1] != k.shape[2]:
        raise ValueError("cos/sin must be [max_pos, head_dim] with a contiguous last dim")
    _launch(k, v, k_cache, v_cache, slot_mapping, (positions.contiguous(), cos, sin))
