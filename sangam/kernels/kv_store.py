"""KV store: write a span's fresh K/V rows into their page slots (DESIGN.md §5.2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_k_n, s_k_h, s_v_n, s_v_h,
    s_kc_page, s_kc_off, s_kc_h, s_vc_page, s_vc_off, s_vc_h,
    num_heads, head_dim, page_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot >= 0:
        page = slot // page_size
        off = slot % page_size
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_heads) & (d < head_dim)
        row = i.to(tl.int64)
        k = tl.load(k_ptr + row * s_k_n + h * s_k_h + d, mask=mask)
        v = tl.load(v_ptr + row * s_v_n + h * s_v_h + d, mask=mask)
        tl.store(kc_ptr + page * s_kc_page + off * s_kc_off + h * s_kc_h + d,
                 k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + page * s_vc_page + off * s_vc_off + h * s_vc_h + d,
                 v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write row i of k/v ``[N, Hkv, D]`` to flat slot ``slot_mapping[i]`` (int64, page *
    page_size + offset; -1 = skip) of ``k_cache``/``v_cache [num_pages, page_size, Hkv, D]``.

    Caches may be strided views (e.g. one layer of a ``PagedKV`` buffer); the head dim must be
    contiguous everywhere. Slots must be distinct.
    """
    n, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    if n == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hkv, d, k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
    )
