"""Page gather/scatter for KV transfer (docs/design.md §4, §5.4).

The pool is one tensor ``kv_buffer [num_layers, 2, num_pages, page_size, Hkv, D]``; a page of one
layer's K (or V) is ``page_size * Hkv * D`` contiguous elements. One launch moves the chosen pages
of every selected layer, K and V, between the pool and a contiguous transfer buffer
``[L, 2, n, page_size, Hkv, D]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sangam.kernels.platform import compiled
from sangam.kernels.reference import layer_indices

# Elements per program: a 16-token bf16 page of LLaDA (32 heads x 128) is 64K elements, so each
# page is split across several programs to give the GPU enough of them for a small transfer.
_GPU_BLOCK = 4096
_CPU_BLOCK = 1024


@triton.jit(do_not_specialize=["layer_start", "layer_step"])  # per transfer
def _page_copy_kernel(
    pool_ptr, buf_ptr, page_ids_ptr,
    layer_start, layer_step,
    pool_s_layer, pool_s_kv, pool_s_page,
    buf_s_layer, buf_s_kv, buf_s_page,
    page_numel,
    TO_POOL: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # page within the request list
    lk = tl.program_id(1)  # (layer, k|v) pair
    chunk = tl.program_id(2)
    li = lk // 2
    kv = lk % 2
    page = tl.load(page_ids_ptr + i).to(tl.int64)
    layer = (layer_start + li * layer_step).to(tl.int64)
    pool_base = layer * pool_s_layer + kv * pool_s_kv + page * pool_s_page
    buf_base = li.to(tl.int64) * buf_s_layer + kv * buf_s_kv + i.to(tl.int64) * buf_s_page
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < page_numel
    if TO_POOL:
        x = tl.load(buf_ptr + buf_base + offs, mask=mask)
        tl.store(pool_ptr + pool_base + offs, x.to(pool_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(pool_ptr + pool_base + offs, mask=mask)
        tl.store(buf_ptr + buf_base + offs, x.to(buf_ptr.dtype.element_ty), mask=mask)


def _check_pool(kv_buffer: torch.Tensor) -> None:
    if kv_buffer.dim() != 6 or kv_buffer.shape[1] != 2:
        raise ValueError(f"kv_buffer must be [L, 2, pages, page_size, Hkv, D], got "
                         f"{tuple(kv_buffer.shape)}")
    if not kv_buffer[0, 0, 0].is_contiguous():
        raise ValueError("each page of kv_buffer must be contiguous")


def _launch(pool: torch.Tensor, buf: torch.Tensor, page_ids: torch.Tensor, lr: range,
            to_pool: bool) -> None:
    n = page_ids.numel()
    if n == 0 or len(lr) == 0:
        return
    page_numel = pool[0, 0, 0].numel()
    block = _GPU_BLOCK if compiled(pool.device) else _CPU_BLOCK
    block = min(block, triton.next_power_of_2(page_numel))
    grid = (n, 2 * len(lr), triton.cdiv(page_numel, block))
    _page_copy_kernel[grid](
        pool, buf, page_ids, lr.start, lr.step,
        pool.stride(0), pool.stride(1), pool.stride(2),
        buf.stride(0), buf.stride(1), buf.stride(2),
        page_numel, TO_POOL=to_pool, BLOCK=block,
    )


def gather_pages(kv_buffer: torch.Tensor, page_ids: torch.Tensor,
                 layers: slice | range | None = None) -> torch.Tensor:
    """Copy pages ``page_ids`` of the selected layers (K and V) into a new contiguous tensor
    ``[L, 2, n, page_size, Hkv, D]``, in the order of ``page_ids``."""
    _check_pool(kv_buffer)
    lr = layer_indices(kv_buffer.shape[0], layers)
    page_ids = page_ids.to(device=kv_buffer.device, dtype=torch.int64).contiguous()
    out = torch.empty((len(lr), 2, page_ids.numel(), *kv_buffer.shape[3:]),
                      dtype=kv_buffer.dtype, device=kv_buffer.device)
    _launch(kv_buffer, out, page_ids, lr, to_pool=False)
    return out


def scatter_pages(buffer: torch.Tensor, kv_buffer: torch.Tensor, page_ids: torch.Tensor,
                  layers: slice | range | None = None) -> None:
    """Write ``buffer [L, 2, n, page_size, Hkv, D]`` (as made by :func:`gather_pages`) into pages
    ``page_ids`` of the selected layers of ``kv_buffer``. Page ids must be distinct."""
    _check_pool(kv_buffer)
    lr = layer_indices(kv_buffer.shape[0], layers)
    expect = (len(lr), 2, page_ids.numel(), *kv_buffer.shape[3:])
    if tuple(buffer.shape) != expect:
        raise ValueError(f"buffer shape {tuple(buffer.shape)} != expected {expect}")
    page_ids = page_ids.to(device=kv_buffer.device, dtype=torch.int64).contiguous()
    _launch(kv_buffer, buffer.contiguous(), page_ids, lr, to_pool=True)
