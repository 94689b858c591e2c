"""Paged bidirectional attention over packed variable-length spans (docs/design.md §5.1).

Request r's query rows ``cu_seqlens_q[r]:cu_seqlens_q[r+1]`` attend, with no causal mask, over
its first ``kv_lens[r]`` cached positions, which live in pages ``block_tables[r]``.

DiffusionGemma: with ``key_bounds`` (per query, [lo, hi)) a query sees only those keys: its
encoder rows causal (sliding-window layers windowed), its canvas rows the canvas and before.

Block-causal models (SDAR): with ``causal_blocks`` (block size per request, 0 = bidirectional)
and ``positions`` (each query's absolute position), a query at position q sees key k only if
k // B <= q // B: bidirectional inside its block, causal across blocks. The bound is per row,
and a tile's KV loop stops at its last row's bound, so a prefill does about half the work.

Layout of the work. For one KV head, the (query, head-in-group) pairs of a request are flattened
into ``qlen * group`` rows, so a tile of BLOCK_M rows holds every query head that shares the K/V
tile it loads: K/V are read once per KV head and tile, and GQA group sizes that are not powers of
two (Dream: 7) waste no padding. Tiles of all requests are numbered consecutively
(``cu_tiles``); a program finds its request by binary search, so the grid size needs no host
sync. One kernel serves refreshes (long spans) and cached steps (32-query spans); when a batch
has too few tiles to fill the GPU, the KV range is split across programs that write partial
results (normalized output + log-sum-exp) and a reduce kernel merges them (flash-decoding).

The split count (:func:`kv_splits`) follows the batch's real shape: its query rows and its
longest KV length (a host int), never the block table's width, so a CUDA graph's wide static
table plans exactly as the eager batch does. It is a power of two (1 to 32), so a graph runner
captures a few graphs per batch size and the merge kernel has few variants. Each request's
split ranges come from its own ``kv_lens`` on the device.

No recompilation per batch: Triton specialises integer arguments on "== 1" and "divisible by
16", so the ones that vary with the batch (request count, search steps, split count, table
stride) are ``do_not_specialize``, and the split buffers are padded so their split strides are
always multiples of 16 (kept specialised: the partials' loads and stores stay 16 bytes wide).
Variants are then set by the constexprs (tiles, SPLIT, BLOCK_S...) alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sangam.kernels.platform import compiled, max_shared_bytes, num_sms

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 512  # a head's dims live in one tile (DiffusionGemma's full layers: 512)


@triton.jit(do_not_specialize=["num_requests", "search_steps", "num_splits", "s_bt"])
def _attn_kernel(
    q_ptr, kc_ptr, vc_ptr, out_ptr, lse_ptr,
    cu_q_ptr, cu_tiles_ptr, bt_ptr, kv_lens_ptr, pos_ptr, cblk_ptr, klo_ptr, khi_ptr,
    ks_ptr, vs_ptr,
    num_requests, search_steps, group, head_dim, num_splits, qk_scale,
    s_q_n, s_q_h,
    s_kc_page, s_kc_off, s_kc_h, s_vc_page, s_vc_off, s_vc_h,
    s_ks_page, s_ks_off, s_ks_h, s_vs_page, s_vs_off, s_vs_h,
    s_bt,
    s_o_split, s_o_n, s_o_h,
    s_lse_split, s_lse_n,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_CAUSAL: tl.constexpr,
    ROW_BOUNDS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
    ACC_DTYPE: tl.constexpr, FP8_KV: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if t < tl.load(cu_tiles_ptr + num_requests):
        # Request of tile t: the r with cu_tiles[r] <= t < cu_tiles[r + 1].
        lo = tl.full([], 0, tl.int32)
        hi = lo + num_requests - 1
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            right = tl.load(cu_tiles_ptr + mid + 1) <= t
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(right, hi, mid)
        r = lo
        q_start = tl.load(cu_q_ptr + r)
        num_rows = (tl.load(cu_q_ptr + r + 1) - q_start) * group
        kv_len = tl.load(kv_lens_ptr + r)

        rows = (t - tl.load(cu_tiles_ptr + r)) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        tok = (q_start + rows // group).to(tl.int64)
        head = kvh * group + rows % group
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < head_dim
        q_off = tok[:, None] * s_q_n + head[:, None] * s_q_h + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q = q.to(DOT_DTYPE)

        if SPLIT:
            chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
            kv_lo = split * chunk
            kv_hi = tl.minimum(kv_len, kv_lo + chunk)
        else:
            kv_lo = kv_len * 0
            kv_hi = kv_len
        if BLOCK_CAUSAL:
            # Each row's keys end with its block: min(kv_len, (pos // B + 1) * B).
            bs = tl.load(cblk_ptr + r)
            pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)
            row_hi = tl.where(bs > 0, (pos // tl.maximum(bs, 1) + 1) * bs, kv_len)
            row_hi = tl.where(row_ok, tl.minimum(row_hi, kv_len), 0)
            kv_hi = tl.minimum(kv_hi, tl.max(row_hi, 0))
        if ROW_BOUNDS:
            # Each row's keys are [key_lo, key_hi) of its token (DiffusionGemma's encoder
            # rows: causal, sliding layers windowed; its canvas rows: the canvas and before).
            row_lo = tl.load(klo_ptr + tok, mask=row_ok, other=0)
            row_hi = tl.load(khi_ptr + tok, mask=row_ok, other=0)
            row_hi = tl.where(row_ok, tl.minimum(row_hi, kv_len), 0)
            row_lo = tl.where(row_ok, row_lo, kv_len)
            kv_hi = tl.minimum(kv_hi, tl.max(row_hi, 0))
            kv_lo = tl.maximum(kv_lo, tl.min(row_lo, 0) // BLOCK_N * BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)
        l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
        bt_row = bt_ptr + r.to(tl.int64) * s_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_hi
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % PAGE_SIZE
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k_off = page * s_kc_page + slot * s_kc_off + kvh * s_kc_h
            k = tl.load(kc_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            if FP8_KV:  # widened through fp32: exact (the interpreter's fp8 -> fp64 fails)
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC)
            if FP8_KV:  # each key's scale multiplies its column of scores
                ks = tl.load(ks_ptr + page * s_ks_page + slot * s_ks_off + kvh * s_ks_h,
                             mask=n_ok, other=0.0)
                s = s * ks[None, :]
            # Scores in log2 units; every tile holds at least one valid key, so m_new is finite.
            s = tl.where(n_ok[None, :], s.to(ACC_DTYPE) * qk_scale, float("-inf"))
            if BLOCK_CAUSAL:
                s = tl.where(offs_n[None, :] < row_hi[:, None], s, float("-inf"))
            if ROW_BOUNDS:
                s = tl.where((offs_n[None, :] < row_hi[:, None])
                             & (offs_n[None, :] >= row_lo[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if BLOCK_CAUSAL or ROW_BOUNDS:  # a row may have seen no key yet: keep it finite
                m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_off = page * s_vc_page + slot * s_vc_off + kvh * s_vc_h
            v = tl.load(vc_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            pw = p
            if FP8_KV:
                v = v.to(tl.float32)  # each value row's scale: on its weight, before the product
                vs = tl.load(vs_ptr + page * s_vs_page + slot * s_vs_off + kvh * s_vs_h,
                             mask=n_ok, other=0.0)
                pw = p * vs[None, :].to(ACC_DTYPE)
            pv = tl.dot(pw.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
            acc = acc * alpha[:, None] + pv.to(ACC_DTYPE)
            m_i = m_new

        # No keys (kv_len 0, or an empty split): output 0, weight 0.
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        o_off = split.to(tl.int64) * s_o_split + tok[:, None] * s_o_n + head[:, None] * s_o_h
        o_mask = row_ok[:, None] & d_ok[None, :]
        if SPLIT:  # an empty split's partial is never read (its lse is -inf): not written
            o_mask = o_mask & has[:, None]
        tl.store(out_ptr + o_off + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
        if SPLIT:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            lse_off = split.to(tl.int64) * s_lse_split + tok * s_lse_n + head
            tl.store(lse_ptr + lse_off, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, head_dim,
    s_p_split, s_p_n, s_p_h, s_lse_split, s_lse_n, s_o_n, s_o_h,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = sp < num_splits
    lse = tl.load(lse_ptr + sp * s_lse_split + n * s_lse_n + h, mask=s_ok, other=float("-inf"))
    lse = lse.to(ACC_DTYPE)
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(w, 0)
    # Only splits that saw keys wrote a partial (a short request's last splits, or a
    # block-causal row's later ones, may see none): the others' reads are skipped.
    mask = (s_ok & (lse > float("-inf")))[:, None] & (offs_d[None, :] < head_dim)
    part = tl.load(part_ptr + sp[:, None] * s_p_split + n * s_p_n + h * s_p_h + offs_d[None, :],
                   mask=mask, other=0.0).to(ACC_DTYPE)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + n * s_o_n + h * s_o_h + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def _tile_config(rows: int, head_dim: int, on_gpu: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for the longest span's flattened (query, head-in-group) row count."""
    block_m = max(16, min(128, triton.next_power_of_2(max(rows, 1))))
    if not on_gpu:
        # Interpreter: numpy cost is per program and op, so moderate tiles are fastest.
        return min(block_m, 32), 32
    if head_dim > 256:  # 512-wide heads: the accumulator alone is 16 rows x 512 fp32
        return min(block_m, 16), 16
    if head_dim > 128:  # 256-wide heads (DiffusionGemma's sliding layers): 64 x 32 tiles
        # spill with per-row key bounds on sm_90, and 32 x 32 does under Triton 3.6; 64 x 16
        # over 8 warps spills under neither (docs/results.md, "Kernels")
        return min(block_m, 64), 16
    return block_m, 64 if block_m >= 64 else 32


def _launch_config(block_m: int, head_dim: int, on_gpu: bool) -> tuple[int, int]:
    """(num_warps, num_stages) for the chosen tiles."""
    if not on_gpu:
        return 1, 1
    if head_dim > 256:  # 16 x 512 tiles: four warps, whose registers hold them unspilled
        return 4, 2
    num_warps = 8 if block_m >= 128 or head_dim > 128 else 4
    return num_warps, 2 if head_dim > 64 else 3


_SHARED_SLACK = 8 * 1024  # what the compiler may add for reductions and layout changes


def _fit_shared(block_m: int, block_n: int, head_dim: int, num_stages: int, elem_bytes: int,
                budget: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_stages) whose shared memory fits ``budget`` bytes: each pipeline
    stage holds a K and a V tile, and the Q tile may be staged too (an upper bound). Only wide
    elements need this (fp64, fp32 on smaller chips): fewer stages first, then narrower K/V
    tiles, then fewer query rows."""
    def need() -> int:
        return (num_stages * 2 * block_n + block_m) * head_dim * elem_bytes + _SHARED_SLACK

    while need() > budget:
        if num_stages > 1:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return block_m, block_n, num_stages


_MAX_SPLITS = 32


def _split_count(programs: int, max_kv_len: int, device: torch.device) -> int:
    """Split the KV loop only when the tiles alone leave most SMs idle (flash-decoding); rounded
    down to a power of two, so CUDA graphs and merge variants cover every count with a few."""
    if not compiled(device):
        return 1
    sms = num_sms(device)
    if programs >= sms or max_kv_len < 512:
        return 1
    want = min(triton.cdiv(2 * sms, programs), max_kv_len // 256, _MAX_SPLITS)
    return 1 << (want.bit_length() - 1)


def _tiles(max_query_len: int, group: int, head_dim: int, elem_bytes: int,
           device: torch.device, block_m: int | None = None,
           block_n: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a batch whose longest span has
    ``max_query_len`` queries (``block_m``/``block_n`` force the tiles)."""
    on_gpu = compiled(device)
    bm, bn = _tile_config(max_query_len * group, head_dim, on_gpu)
    bm = block_m or bm
    bn = block_n or bn
    num_warps, num_stages = _launch_config(bm, head_dim, on_gpu)
    if on_gpu and block_m is None and block_n is None:
        bm, bn, num_stages = _fit_shared(bm, bn, head_dim, num_stages, elem_bytes,
                                         max_shared_bytes(device))
    return bm, bn, num_warps, num_stages


def _programs(num_tokens: int, group: int, num_kv_heads: int, block_m: int) -> int:
    """Query tiles of a batch times KV heads: the programs of an unsplit launch (about)."""
    return triton.cdiv(num_tokens * group, block_m) * num_kv_heads


def kv_splits(num_tokens: int, max_query_len: int, max_kv_len: int, num_heads: int,
              num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """The KV split count :func:`plan_attention` chooses (tiles not forced) for a batch of
    ``num_tokens`` queries in spans of at most ``max_query_len``, whose longest KV length is
    ``max_kv_len``: a power of two from 1 to 32 (1 off-GPU). Nondecreasing in ``max_kv_len``,
    through every power of two up to its value at the longest context; nonincreasing in
    ``num_tokens``."""
    group = num_heads // num_kv_heads
    bm = _tiles(max_query_len, group, head_dim, dtype.itemsize, device)[0]
    return _split_count(_programs(num_tokens, group, num_kv_heads, bm), max_kv_len, device)


@dataclass(frozen=True)
class AttentionPlan:
    """What a batch's attention launch needs beyond the tensors of one layer, the same for every
    layer of a forward: tiles, warps, KV splits, the tile -> request map and the split buffers.
    ``plan_attention`` makes it once; every layer's ``paged_attention`` call reuses it."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_splits: int
    on_gpu: bool
    dot_dtype: tl.dtype
    acc_dtype: tl.dtype
    cu_q: torch.Tensor  # int32 [R + 1]
    cu_tiles: torch.Tensor  # int32 [R + 1]: first query tile of each request
    grid: tuple[int, int, int]
    # [splits, N, Hq, D] partial outputs (split-KV only; views of row-padded buffers)
    part: torch.Tensor | None
    lse: torch.Tensor | None  # [splits, N, Hq] their log-sum-exps


def plan_attention(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   block_tables: torch.Tensor, *, max_kv_len: int | None = None,
                   max_query_len: int | None = None, num_splits: int | None = None,
                   block_m: int | None = None, block_n: int | None = None) -> AttentionPlan:
    """The launch plan of :func:`paged_attention` for a batch (arguments as there).
    ``max_kv_len`` (host int): the batch's longest KV length, which sets the split count
    (:func:`kv_splits`); default: the tables' capacity, an upper bound that splits as if every
    request filled its table, so callers that know the lengths pass it."""
    n_tok, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    num_requests = cu_seqlens_q.numel() - 1
    on_gpu = compiled(q.device)
    if k_cache.dtype == torch.float8_e4m3fn and on_gpu and block_n is None:
        # The FP8 pages' scale loads and widening: 128 x 64 refresh tiles spill on sm_90.
        block_n = 32
    bm, bn, num_warps, num_stages = _tiles(
        max_query_len if max_query_len is not None else n_tok, group, d, q.element_size(),
        q.device, block_m, block_n)
    if num_splits is None:
        if max_kv_len is None:
            max_kv_len = block_tables.shape[1] * page_size
        num_splits = _split_count(_programs(n_tok, group, hkv, bm), max_kv_len, q.device)
    num_splits = max(1, int(num_splits))

    acc_dtype = tl.float64 if q.dtype == torch.float64 else tl.float32
    if q.dtype == torch.float64:
        dot_dtype = tl.float64
    elif on_gpu and q.dtype in (torch.bfloat16, torch.float16):
        dot_dtype = tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
    else:  # fp32, or half types in the interpreter, whose bf16 dot is wrong
        dot_dtype = tl.float32

    cu_q = cu_seqlens_q.to(torch.int32)
    tiles = ((cu_q[1:] - cu_q[:-1]) * group + bm - 1) // bm
    cu_tiles = torch.zeros(num_requests + 1, dtype=torch.int32, device=q.device)
    cu_tiles[1:] = torch.cumsum(tiles, 0)
    grid = (n_tok * group // bm + num_requests, hkv, num_splits)
    part = lse = None
    if num_splits > 1:
        part_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        # Rows padded to a multiple of 16: split strides divisible by 16 in every batch (one
        # kernel variant, wide loads and stores).
        rows = -(-n_tok // 16) * 16
        part = torch.empty((num_splits, rows, hq, d), dtype=part_dtype,
                           device=q.device)[:, :n_tok]
        lse = torch.empty((num_splits, rows, hq), dtype=part_dtype, device=q.device)[:, :n_tok]
    return AttentionPlan(bm, bn, num_warps, num_stages, num_splits, on_gpu, dot_dtype, acc_dtype,
                         cu_q, cu_tiles, grid, part, lse)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                    max_kv_len: int | None = None, num_splits: int | None = None,
                    block_m: int | None = None, block_n: int | None = None,
                    plan: AttentionPlan | None = None,
                    causal_blocks: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None,
                    key_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional paged attention for packed spans; returns ``[N, Hq, D]`` in q's dtype.

    q ``[N, Hq, D]``; k_cache/v_cache ``[num_pages, page_size, Hkv, D]`` (head dim contiguous;
    per-layer views of a ``PagedKV`` buffer are fine); cu_seqlens_q int32 ``[R+1]``;
    block_tables int32 ``[R, max_pages]``; kv_lens int32 ``[R]``. ``max_query_len`` (host int,
    optional) only sharpens the tile choice; ``max_kv_len`` (host int, optional: the longest
    of kv_lens) sets the number of KV splits, ``num_splits`` forces it (default: chosen from the
    batch shape, 1 off-GPU); ``block_m``/``block_n`` force tile sizes (powers of two >= 16).
    ``plan`` (from :func:`plan_attention` for this batch) replaces those five and saves
    re-planning in every layer. Accumulates in fp32 (fp64 for fp64 inputs).
    ``causal_blocks`` int32 ``[R]`` with ``positions`` int ``[N]``: the block-causal mask (see
    the module docstring). ``key_bounds`` (int32 ``[N]`` each, instead): query i sees the keys
    ``[lo[i], hi[i])`` of its request (within ``kv_lens``); a row with none outputs 0.
    FP8 caches (float8_e4m3fn) come with ``k_scales``/``v_scales [num_pages, page_size, Hkv]``:
    a key's scale multiplies its scores, a value's its softmax weights (PagedKV's layout).
    """
    n_tok, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    if v_cache.shape != k_cache.shape or dk != d or hq % hkv:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    if page_size & (page_size - 1) or d & (d - 1) or d > MAX_HEAD_DIM:
        raise ValueError(f"page_size and head_dim must be powers of two (head_dim <= "
                         f"{MAX_HEAD_DIM}), got {page_size} and {d}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head dim must be contiguous")
    num_requests = cu_seqlens_q.numel() - 1
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scales is None or v_scales is None or k_scales.shape != k_cache.shape[:3]
                or v_scales.shape != k_cache.shape[:3]):
        raise ValueError("an FP8 cache needs k_scales and v_scales [num_pages, page_size, Hkv]")
    ks, vs = (k_scales, v_scales) if fp8 else (kv_lens, kv_lens)
    block_causal = causal_blocks is not None
    if block_causal and (positions is None or positions.numel() != n_tok
                         or causal_blocks.numel() != num_requests):
        raise ValueError("causal_blocks needs one block size per request and positions one "
                         "position per query")
    bounded = key_bounds is not None
    if bounded and (block_causal or any(b.numel() != n_tok for b in key_bounds)):
        raise ValueError("key_bounds needs a [lo, hi) per query, and no causal_blocks")
    out = torch.empty((n_tok, hq, d), dtype=q.dtype, device=q.device)
    if n_tok == 0 or num_requests == 0:
        return out
    p = plan or plan_attention(q, k_cache, cu_seqlens_q, block_tables, max_kv_len=max_kv_len,
                               max_query_len=max_query_len, num_splits=num_splits,
                               block_m=block_m, block_n=block_n)
    split = p.num_splits > 1
    part, lse = (p.part, p.lse) if split else (out, out)  # lse is unused without splits
    _attn_kernel[p.grid](
        q, k_cache, v_cache, part, lse,
        p.cu_q, p.cu_tiles, block_tables, kv_lens.to(torch.int32),
        positions if block_causal else kv_lens, causal_blocks if block_causal else kv_lens,
        *(key_bounds if bounded else (kv_lens, kv_lens)), ks, vs,
        num_requests, num_requests.bit_length(), hq // hkv, d, p.num_splits, scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *(k_scales.stride() + v_scales.stride() if fp8 else (0,) * 6),
        block_tables.stride(0),
        part.stride(0) if split else 0, part.stride(-3), part.stride(-2),
        lse.stride(0) if split else 0, lse.stride(-2) if split else 0,
        PAGE_SIZE=page_size, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_D=max(16, d),
        SPLIT=split, BLOCK_CAUSAL=block_causal, ROW_BOUNDS=bounded, DOT_DTYPE=p.dot_dtype,
        ACC_DTYPE=p.acc_dtype, FP8_KV=fp8,
        # fp32/fp64 dots in full precision (no TF32); half types use the tensor cores as is.
        DOT_PREC="ieee" if p.dot_dtype in (tl.float32, tl.float64) else "tf32",
        num_warps=p.num_warps, num_stages=p.num_stages,
    )
    if split:
        _merge_splits_kernel[(n_tok, hq)](
            part, lse, out, p.num_splits, d,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(p.num_splits), BLOCK_D=max(16, d),
            ACC_DTYPE=p.acc_dtype, num_warps=4 if p.on_gpu else 1,
        )
    return out
