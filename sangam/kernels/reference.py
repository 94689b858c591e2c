"""PyTorch references of every kernel: the test oracles and the CPU fallback.

Each takes the same tensors as its kernel. They are exact (fp32 or better accumulation) and
deliberately plain; the host lists some of them accept only save a device sync.
"""

from __future__ import annotations

import torch

# FP8 (e4m3): linear layers (kernels/fp8_gemm.py, models/quantization.py) and KV caches.
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_GROUP = 128  # input features per activation scale, and the weight blocks' side
FP8_AMAX_FLOOR = 1e-12  # an all-zero group's amax: its scale stays finite
# How a layer's activations are quantized: not at all (FP8 weights widened), dynamically per
# token and group of FP8_GROUP features, or by the checkpoint's static per-tensor scale.
FP8_ACTIVATIONS = ("none", "dynamic", "static")


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
                 slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> None:
    """Write row i of k/v ``[N, Hkv, D]`` to flat slot ``slot_mapping[i]`` of the caches
    ``[num_pages, page_size, Hkv, D]``; slot -1 means skip. FP8 caches (float8_e4m3fn) take
    each row's heads as :func:`quantize_kv_ref` makes them, their scales into ``k_scales`` /
    ``v_scales`` ``[num_pages, page_size, Hkv]``."""
    slots = slot_mapping
    if bool((slots < 0).any()):  # only padded (CUDA-graph) batches skip rows
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if cache.dtype == torch.float8_e4m3fn:
            _need_scales(cache, scales)
            x, s = quantize_kv_ref(x)
            _put_rows(scales, slots, s)
        _put_rows(cache, slots, x.to(cache.dtype))


def _need_scales(cache: torch.Tensor, scales: torch.Tensor | None) -> None:
    """An FP8 cache is read and written only with its scales ``[num_pages, page_size, Hkv]``."""
    if scales is None or scales.shape != cache.shape[:3]:
        raise ValueError("an FP8 cache needs its scales [num_pages, page_size, Hkv]")


def _put_rows(pages: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``pages [num_pages, page_size, ...]``'s flat slots ``slots`` set to ``rows``. The pages
    may be strided (an FP8 pool's rows between its pages' scale rows); float8 goes as bytes
    (index_put_ lacks it)."""
    if pages.dtype == torch.float8_e4m3fn:
        pages, rows = pages.view(torch.uint8), rows.view(torch.uint8)
    if pages.is_contiguous():
        pages.view(-1, *pages.shape[2:]).index_copy_(0, slots, rows)
    else:
        page_size = pages.shape[1]
        pages[slots // page_size, slots % page_size] = rows


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows ``[N, Hkv, D]`` as an FP8 KV cache holds them: each row's head scaled by its
    amax / FP8_MAX (fp32) -> (float8_e4m3fn ``[N, Hkv, D]``, scales ``[N, Hkv]``)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR) / FP8_MAX
    return (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _cached(cache: torch.Tensor, scales: torch.Tensor | None, pages: torch.Tensor, kv_len: int,
            dtype: torch.dtype) -> torch.Tensor:
    """A request's first ``kv_len`` cached rows ``[1, Hkv, kv_len, D]`` in ``dtype`` (FP8
    ones times their scales)."""
    if cache.dtype == torch.float8_e4m3fn:
        _need_scales(cache, scales)
    x = cache[pages].flatten(0, 1)[:kv_len].to(dtype)
    if scales is not None:
        x = x * scales[pages].flatten(0, 1)[:kv_len].to(dtype)[..., None]
    return x.transpose(0, 1)[None]


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
                        positions: torch.Tensor | None = None,
                        key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                        k_scales: torch.Tensor | None = None,
                        v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Each request's queries attend, without a causal mask, over its first ``kv_lens[r]`` cached
    positions: gather the pages, then softmax attention in fp32 (fp64 for fp64 inputs) through
    ``scaled_dot_product_attention`` (K/V heads shared by query heads are never repeated).
    With ``causal_blocks`` (block size B per request, 0 = none) and ``positions`` (each query's
    absolute position), a query at q sees key k only if k // B <= q // B (block-causal). With
    ``key_bounds`` (lo, hi: ``[N]`` each) query i sees keys lo[i] <= k < hi[i]; a query that
    sees none outputs 0. FP8 caches are read times their per-row, per-head ``k_scales`` /
    ``v_scales``."""
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
        kk = _cached(k_cache, k_scales, pages, kv_len, acc)
        vv = _cached(v_cache, v_scales, pages, kv_len, acc)
        qq = q[start:start + n].to(acc).transpose(0, 1)[None]
        mask = None
        if blocks is not None and blocks[r] > 0:
            bs = blocks[r]
            q_block = positions[start:start + n].to(kk.device).long() // bs
            mask = (torch.arange(kv_len, device=kk.device) // bs)[None, :] <= q_block[:, None]
        if key_bounds is not None:
            keys = torch.arange(kv_len, device=kk.device)[None, :]
            lo, hi = (b[start:start + n].to(kk.device).long()[:, None] for b in key_bounds)
            mask = (keys >= lo) & (keys < hi)
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                             scale=scale, enable_gqa=gqa)
        if mask is not None:  # a row without keys: 0, as the kernel gives (not sdpa's NaN)
            o = o.masked_fill(~mask.any(-1)[None, None, :, None], 0.0)
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


ROUTER_SCORES = ("sigmoid", "softmax")


def check_route_args(num_experts: int, *, top_k: int, score: str, bias: torch.Tensor | None,
                     n_group: int, topk_group: int) -> None:
    """Raise ValueError unless the router arguments describe a valid grouped top-k over
    ``num_experts`` experts (shared by :func:`moe_route_ref` and the Triton router)."""
    if score not in ROUTER_SCORES:
        raise ValueError(f"score must be one of {ROUTER_SCORES}, got {score!r}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must divide the {num_experts} experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    kept = topk_group * (num_experts // n_group)
    if not 1 <= top_k <= kept:
        raise ValueError(f"top_k must be in [1, {kept}] (the experts of the {topk_group} kept "
                         f"groups), got {top_k}")
    if score == "softmax" and (bias is not None or n_group != 1 or topk_group != 1):
        raise ValueError("softmax routing takes no bias and no expert groups")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},), got {tuple(bias.shape)}")


def moe_route_ref(logits: torch.Tensor, *, top_k: int, score: str,
                  bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                  renormalize: bool = True,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: logits ``[T, E]`` -> (weights ``[T, top_k]`` in the compute dtype (fp64 for fp64
    logits, else fp32), ids ``[T, top_k]`` int32).

    ``sigmoid`` (LLaDA2 / DeepSeek-V3): s = sigmoid(logits), chosen by c = s + bias within the
    ``topk_group`` best of ``n_group`` contiguous expert groups (a group's score: the sum of its
    two best c, its one c if it holds a single expert); the weights are the unbiased s.
    ``softmax`` (OLMoE / LLaDA-MoE): s = softmax(logits), top_k by s. The weights are
    renormalised to sum 1 when ``renormalize``, then times ``scale``. Ties go to the lower index
    (stable sorts), for groups and experts alike, so the choice is deterministic."""
    num_tokens, num_experts = logits.shape
    check_route_args(num_experts, top_k=top_k, score=score, bias=bias, n_group=n_group,
                     topk_group=topk_group)
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt)
    if score == "sigmoid":
        s = torch.sigmoid(x)
        c = s if bias is None else s + bias.to(device=x.device, dtype=cdt)
    else:
        s = c = torch.softmax(x, dim=-1)
    if topk_group < n_group:
        groups = c.view(num_tokens, n_group, num_experts // n_group)
        best = torch.sort(groups, dim=-1, descending=True, stable=True).values
        group_score = best[..., :2].sum(-1)  # one value when a group holds one expert
        kept = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, kept[:, :topk_group], True)
        c = groups.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)
    ids = torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


MOE_ACTIVATIONS = ("silu", "gelu_tanh")  # an expert's gate activation (the kernels' ACT index)


def moe_activation(name: str):
    """The gate activation ``name`` (one of ``MOE_ACTIVATIONS``) as a torch function."""
    if name == "silu":
        return torch.nn.functional.silu
    if name == "gelu_tanh":
        return lambda g: torch.nn.functional.gelu(g, approximate="tanh")
    raise ValueError(f"expert activation must be one of {MOE_ACTIVATIONS}, got {name!r}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  partial: bool = False, activation: str = "silu",
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_weights: bool = False) -> torch.Tensor:
    """x ``[T, H]``; w13 ``[E, 2I, H]`` (rows 0..I-1: gate_proj, rows I..2I-1: up_proj); w2
    ``[E, H, I]`` (down_proj); topk_weights, topk_ids ``[T, K]`` -> ``[T, H]`` = sum_k w[t,k] *
    w2[e] @ (act(w13[e,:I] @ x[t]) * (w13[e,I:] @ x[t])), e = ids[t,k], act one of
    ``MOE_ACTIVATIONS`` (silu: SwiGLU; gelu_tanh: Gemma's GeGLU). Output in x's dtype;
    accumulates in fp32 (fp64 for fp64 x).

    Experts run one at a time on the rows routed to them (one host sync reads how many each
    got); each (token, k) result lands in its own row of a ``[T, K, H]`` buffer, summed over k.
    A token routed twice to one expert is an error (the routers never do it), checked except
    while a CUDA graph is being captured (the check reads the device). Ids equal to ``E``
    name experts other ranks hold (expert parallelism) and contribute nothing; ``partial``,
    which tells the kernel to expect them, is taken for its signature.

    FP8 experts (w13/w2 float8_e4m3fn, with ``w13_scale``/``w2_scale``: see
    :func:`dequantize_fp8_experts`): both GEMMs' inputs are quantized per token and group of
    FP8_GROUP features (:func:`quantize_fp8_groups_ref`), the intermediate after its rounding
    to x's dtype, as the kernel does."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    act_fn = moe_activation(activation)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if k > 1 and not capturing:
        ordered = torch.sort(topk_ids, dim=1).values
        twice = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] < num_experts)
        if bool(twice.any()):
            raise ValueError("a token is routed to the same expert twice")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        w13 = dequantize_fp8_experts(w13, w13_scale, cdt, block_weights, gate_up=True)
        w2 = dequantize_fp8_experts(w2, w2_scale, cdt, block_weights)
    xf = _fp8_groups_dequantized(x, cdt) if fp8 else x.to(cdt)
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]  # those held elsewhere sort last and are left out
    per_pair = torch.zeros(num_tokens * k, hidden, dtype=cdt, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        gate_up = xf[pairs // k] @ w13[e].to(cdt).T
        act = act_fn(gate_up[:, :inter]) * gate_up[:, inter:]
        if fp8:  # the kernel's intermediate: stored in x's dtype, then quantized
            act = _fp8_groups_dequantized(act.to(x.dtype), cdt)
        per_pair[pairs] = (act @ w2[e].to(cdt).T) * topk_weights.reshape(-1)[pairs, None].to(cdt)
    return per_pair.view(num_tokens, k, hidden).sum(1).to(x.dtype)


def quantize_fp8_groups_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> (float8_e4m3fn ``[M, K]``, fp32 scales ``[M, ceil(K / FP8_GROUP)]``):
    each token's groups of FP8_GROUP features scaled by their amax / FP8_MAX (in fp32)."""
    m, k = x.shape
    groups = -(-k // FP8_GROUP)
    xf = torch.nn.functional.pad(x.to(torch.float32), (0, groups * FP8_GROUP - k))
    xf = xf.view(m, groups, FP8_GROUP)
    scale = xf.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * FP8_GROUP)[:, :k], scale


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       block: bool) -> torch.Tensor:
    """FP8 ``weight [..., N, K]`` times its scales, in ``dtype``: per block of FP8_GROUP x
    FP8_GROUP (``block``: scale ``[..., ceil(N/128), ceil(K/128)]``), else per output channel
    (scale ``[..., N]`` or ``[..., N, 1]``) or per tensor (one value)."""
    w = weight.to(dtype)
    s = scale.to(dtype)
    if block:
        n, k = w.shape[-2:]
        s = s.repeat_interleave(FP8_GROUP, -2)[..., :n, :]
        s = s.repeat_interleave(FP8_GROUP, -1)[..., :k]
        return w * s
    if s.numel() == 1:
        return w * s.reshape(())
    return w * s.reshape(*w.shape[:-1], 1)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                   activation: str = "dynamic", input_scale: torch.Tensor | None = None,
                   block_weights: bool = False, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """:func:`sangam.kernels.fp8_gemm.fp8_linear`'s reference: x's FP8 values and scales as
    the kernel makes them (``activation``, one of FP8_ACTIVATIONS), times the dequantized
    weight, in fp32 (fp64 for fp64 x); the result in x's dtype."""
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    k = weight.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if activation == "dynamic":
        q, s = quantize_fp8_groups_ref(x2)
        xd = q.to(cd) * s.to(cd).repeat_interleave(FP8_GROUP, -1)[:, :k]
    elif activation == "static":
        s = input_scale.to(torch.float32).reshape(())
        q = (x2.to(torch.float32) / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        xd = q.to(cd) * s.to(cd)
    elif activation == "none":
        xd = x2.to(cd)
    else:
        raise ValueError(f"activation must be one of {FP8_ACTIVATIONS}, got {activation!r}")
    out = (xd @ dequantize_fp8_ref(weight, weight_scale, cd, block_weights).T).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.view(*lead, weight.shape[0])


def _fp8_groups_dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as its FP8 values per token and group (:func:`quantize_fp8_groups_ref`) times their
    scales, in ``dtype``: what an FP8 GEMM multiplies."""
    q, s = quantize_fp8_groups_ref(x)
    return q.to(dtype) * s.to(dtype).repeat_interleave(FP8_GROUP, -1)[:, :x.shape[1]]


def dequantize_fp8_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                           block: bool, gate_up: bool = False) -> torch.Tensor:
    """Stacked FP8 expert weights ``[E, N, K]`` in ``dtype``. Block scales: ``[E, ceil(N/128),
    ceil(K/128)]``, for ``gate_up`` (w13: gate rows, then up rows) the gate's blocks then the
    up's, each half blocked on its own; per-channel scales: ``[E, N]``."""
    if not block:
        return w.to(dtype) * scale.to(dtype)[..., None]
    if not gate_up:
        return dequantize_fp8_ref(w, scale, dtype, block=True)
    half, blocks = w.shape[1] // 2, scale.shape[1] // 2
    return torch.cat([dequantize_fp8_ref(w[:, :half], scale[:, :blocks], dtype, block=True),
                      dequantize_fp8_ref(w[:, half:], scale[:, blocks:], dtype, block=True)],
                     dim=1)
