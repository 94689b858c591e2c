"""PyTorch references of every kernel: the test oracles and the CPU fallback.

Each takes the same tensors as its kernel. They are exact (fp32 or better accumulation) and
deliberately plain; the host lists some of them accept only save a device sync.
"""

from __future__ import annotations

import torch


def layer_indices(num_layers: int, layers: slice | range | None) -> range:
    """The layers a transfer touches, as a range (``None`` = all)."""
    if layers is None:
        return range(num_layers)
    if isinstance(layers, slice):
        return range(num_layers)[layers]
    if isinstance(layers, range):
        if len(layers) and not (0 <= layers[0] < num_layers and 0 <= layers[-1] < num_layers):
            raise IndexError(f"layers {layers} out of range for {num_layers} layers")
        return layers
    raise TypeError(f"layers must be a slice, a range or None, not {type(layers).__name__}")


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write row i of k/v ``[N, Hkv, D]`` to flat slot ``slot_mapping[i]`` of the caches
    ``[num_pages, page_size, Hkv, D]``; slot -1 means skip."""
    slots, k, v = slot_mapping, k.to(k_cache.dtype), v.to(v_cache.dtype)
    if bool((slots < 0).any()):  # only padded (CUDA-graph) batches skip rows
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def store_kv_rope_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate k (rotate-half RoPE, tables ``[max_pos, D]``) in fp32 (fp64 for fp64 k), then
    :func:`store_kv_ref`."""
    cdt = torch.float64 if k.dtype == torch.float64 else torch.float32
    c = cos[positions].to(cdt).unsqueeze(-2)
    s = sin[positions].to(cdt).unsqueeze(-2)
    kf = k.to(cdt)
    half = k.shape[-1] // 2
    rotated = torch.cat([-kf[..., half:], kf[..., :half]], dim=-1)
    store_kv_ref(kf * c + rotated * s, v, k_cache, v_cache, slot_mapping)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: torch.Tensor, scale: float, *,
                        query_lens: list[int] | None = None,
                        kv_lens_host: list[int] | None = None,
                        causal_blocks: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """Each request's queries attend, without a causal mask, over its first ``kv_lens[r]`` cached
    positions: gather the pages, then softmax attention in fp32 (fp64 for fp64 inputs) through
    ``scaled_dot_product_attention`` (K/V heads shared by query heads are never repeated).
    With ``causal_blocks`` (block size B per request, 0 = none) and ``positions`` (each query's
    absolute position), a query at q sees key k only if k // B <= q // B (block-causal)."""
    page_size = k_cache.shape[1]
    gqa = q.shape[1] != k_cache.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if query_lens is None:
        query_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    if kv_lens_host is None:
        kv_lens_host = kv_lens.tolist()
    out = torch.zeros_like(q)
    blocks = None if causal_blocks is None else causal_blocks.tolist()
    start = 0
    for r, (n, kv_len) in enumerate(zip(query_lens, kv_lens_host, strict=True)):
        if n == 0 or kv_len == 0:
            start += n
            continue
        pages = block_tables[r, : -(-kv_len // page_size)].long()
        # [1, heads, positions, D], as scaled_dot_product_attention takes them.
        kk = k_cache[pages].flatten(0, 1)[:kv_len].to(acc).transpose(0, 1)[None]
        vv = v_cache[pages].flatten(0, 1)[:kv_len].to(acc).transpose(0, 1)[None]
        qq = q[start:start + n].to(acc).transpose(0, 1)[None]
        mask = None
        if blocks is not None and blocks[r] > 0:
            bs = blocks[r]
            q_block = positions[start:start + n].to(kk.device).long() // bs
            mask = (torch.arange(kv_len, device=kk.device) // bs)[None, :] <= q_block[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                             scale=scale, enable_gqa=gqa)
        out[start:start + n] = o[0].transpose(0, 1).to(q.dtype)
        start += n
    return out


def gather_pages_ref(kv_buffer: torch.Tensor, page_ids: torch.Tensor,
                     layers: slice | range | None = None) -> torch.Tensor:
    """``kv_buffer[layers, :, page_ids]`` as a new contiguous tensor; only those pages are read
    (the layers are a view, the pages the one copy)."""
    lr = layer_indices(kv_buffer.shape[0], layers)
    pages = page_ids.to(kv_buffer.device).long()
    if len(lr) and lr.step < 0:  # tensors slice forwards only: gather forwards, then flip
        return gather_pages_ref(kv_buffer, page_ids, lr[::-1]).flip(0)
    return kv_buffer[lr.start:lr.start + len(lr) * lr.step:lr.step, :, pages].contiguous()


def scatter_pages_ref(buffer: torch.Tensor, kv_buffer: torch.Tensor, page_ids: torch.Tensor,
                      layers: slice | range | None = None) -> None:
    """``kv_buffer[layers, :, page_ids] = buffer``."""
    pages = page_ids.to(kv_buffer.device).long()
    for j, layer in enumerate(layer_indices(kv_buffer.shape[0], layers)):
        kv_buffer[layer, :, pages] = buffer[j].to(kv_buffer.dtype)
