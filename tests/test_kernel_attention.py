"""Paged bidirectional attention kernel vs its PyTorch reference.

CPU tensors under the Triton interpreter (fp32, fp64); bf16 on CUDA when a GPU is present.
Shapes are tiny: the interpreter costs milliseconds per program.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from sangam.kernels.paged_attention import paged_attention, plan_attention
from sangam.kernels.reference import paged_attention_ref
from sangam.models.attention import PagedKV

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
TOL = {torch.float32: (2e-5, 2e-5), torch.float64: (1e-12, 1e-12),
       torch.bfloat16: (3e-2, 2e-2)}


def make_batch(query_lens, kv_lens, hq, hkv, d, page_size, device, dtype, seed=0,
               spare_pages=3):
    """Random pages, shuffled page numbers per request, block tables padded with -1."""
    g = torch.Generator().manual_seed(seed)
    per_req = [-(-k // page_size) for k in kv_lens]
    num_pages = sum(per_req) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(kv_lens), max(per_req + [1]) + 1), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_req):
        table[r, :n] = perm[used:used + n]
        used += n
    k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g)
    v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g)
    q = torch.randn(sum(query_lens), hq, d, generator=g)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    to = dict(device=device)
    return (q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype),
            cu.to(**to), table.to(**to), torch.tensor(kv_lens, dtype=torch.int32, **to))


def check(query_lens, kv_lens, hq, hkv, d, page_size, device, dtype, **kw):
    q, kc, vc, cu, bt, kvl = make_batch(query_lens, kv_lens, hq, hkv, d, page_size, device, dtype)
    scale = d ** -0.5
    out = paged_attention(q, kc, vc, cu, bt, kvl, scale, **kw)
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    return out


@pytest.mark.parametrize("device,dtype", CASES)
def test_refresh_span_crosses_pages(device, dtype):
    # 40 queries over 40 keys: pages of 16, the last one partial; 3 query tiles.
    check([40], [40], 2, 2, 16, 16, device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1), (14, 2)],
                         ids=["g1", "g4", "g7", "g7x2"])
def test_gqa_groups_packed_requests(device, dtype, hq, hkv):
    # Varied spans, kv_lens not multiples of the page (8) or tile (32).
    check([3, 17, 1], [21, 45, 8], hq, hkv, 16, 8, device, dtype)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
@pytest.mark.parametrize("page_size,block_n", [(4, 16), (8, 32), (16, 16), (32, 16), (64, 32)])
def test_page_sizes_and_kv_tiles(device, dtype, page_size, block_n):
    """KV tiles spanning several pages, exactly one page, and a fraction of one."""
    check([5, 9], [50, 77], 4, 2, 16, page_size, device, dtype, block_n=block_n)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (7, 1)], ids=["g1", "g7"])
def test_cached_steps_of_32_queries(device, dtype, hq, hkv):
    """The decode shape: 32-query block spans over the whole cached sequence."""
    check([32, 32, 32], [70, 45, 96], hq, hkv, 32, 16, device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_path(device, dtype, num_splits):
    # 7 splits of a 40-key request leave some splits empty (chunks round up to the tile).
    check([9, 4], [150, 40], 4, 2, 16, 16, device, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
def test_empty_splits_are_neither_written_nor_read(device, dtype):
    """Splits past a request's KV hold no partial: the split buffers start as NaN (a graph's
    buffers hold an earlier layer's, or anything), and the result is still exact."""
    q, kc, vc, cu, bt, kvl = make_batch([9, 4, 3], [150, 40, 0], 4, 2, 16, 16, device, dtype)
    plan = plan_attention(q, kc, cu, bt, num_splits=8, block_n=16)
    plan.part.fill_(float("nan"))
    plan.lse.fill_(float("nan"))
    out = paged_attention(q, kc, vc, cu, bt, kvl, 0.25, plan=plan)
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, 0.25)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    assert not plan.lse.isnan().any()  # every split's lse is written, -inf when empty
    assert plan.part[3:, 9:13].isnan().all()  # 40 keys fill 3 splits of 16: the rest unwritten


@pytest.mark.parametrize("device,dtype", FAST_CASES)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_query_tile_sizes(device, dtype, block_m):
    check([33, 2], [20, 30], 8, 2, 16, 8, device, dtype, block_m=block_m)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
@pytest.mark.parametrize("d", [8, 64, 128, 512])  # 512: DiffusionGemma's full layers
def test_head_dims(device, dtype, d):
    check([6, 3], [19, 33], 4, 1, d, 16, device, dtype)


@pytest.mark.parametrize("device,dtype", FAST_CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_spans_and_empty_kv(device, dtype, num_splits):
    """A request with no queries is skipped; one with no keys gets zeros (as the reference)."""
    out = check([4, 0, 3], [25, 10, 0], 4, 2, 16, 8, device, dtype, num_splits=num_splits)
    assert not out[4:].any()


@pytest.mark.parametrize("device,dtype", FAST_CASES)
def test_paged_kv_layer_views_and_max_query_len(device, dtype):
    """Caches that are strided views of one layer of the shared pool."""
    q, kc, vc, cu, bt, kvl = make_batch([5, 7], [30, 12], 4, 2, 16, 8, device, dtype)
    kv = PagedKV.allocate(2, kc.shape[0], 8, 2, 16, dtype, device)
    kv.buffer[1, 0].copy_(kc)
    kv.buffer[1, 1].copy_(vc)
    out = paged_attention(q, kv.k[1], kv.v[1], cu, bt, kvl, 0.25, max_query_len=7)
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, 0.25)
    torch.testing.assert_close(out, ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=_GPU)])
def test_auto_split_on_gpu(device, dtype):
    """Small batch, long KV: the heuristic picks the split path by itself."""
    check([32], [2000], 32, 32, 128, 16, device, dtype)
    check([32, 32], [4096, 1000], 28, 4, 128, 16, device, dtype)
    check([512], [512], 28, 4, 128, 16, device, dtype)


def _block_causal_oracle(q, kc, vc, cu, bt, kvl, scale, blocks, positions):
    """The block-causal mask as bidirectional attention of one sub-request per (request,
    block): the rows of block j see the first min(kv_len, (j + 1) B) keys."""
    outs = torch.zeros_like(q)
    cuts = cu.tolist()
    for r, bs in enumerate(blocks.tolist()):
        for i in range(cuts[r], cuts[r + 1]):
            lim = kvl[r].item() if bs == 0 else min(kvl[r].item(),
                                                    (positions[i].item() // bs + 1) * bs)
            one = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
            outs[i:i + 1] = paged_attention_ref(q[i:i + 1], kc, vc, one, bt[r:r + 1],
                                                torch.tensor([lim], dtype=torch.int32), scale)
    return outs


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_block_causal_mask(device, dtype, num_splits):
    """SDAR's mask: a query sees keys of its own block and the blocks before. Mixed block sizes
    and a bidirectional request in one batch; spans that start mid-canvas (a cached block step
    spanning the finished block and the new one), a prompt prefill, GQA, KV splits."""
    query_lens, kv_lens = [8, 37, 5, 12], [24, 37, 40, 30]
    blocks = torch.tensor([4, 8, 0, 4], dtype=torch.int32)
    starts = [16, 0, 35, 12]  # span [16, 24) = two blocks of 4; [0, 37) a prefill with a tail
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, query_lens)])
    q, kc, vc, cu, bt, kvl = make_batch(query_lens, kv_lens, 8, 2, 16, 8, device, dtype)
    scale = 16 ** -0.5
    kw = dict(causal_blocks=blocks.to(device), positions=positions.to(device))
    out = paged_attention(q, kc, vc, cu, bt, kvl, scale, num_splits=num_splits, **kw)
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, scale, **kw)
    oracle = _block_causal_oracle(q.cpu(), kc.cpu(), vc.cpu(), cu.cpu(), bt.cpu(), kvl.cpu(),
                                  scale, blocks, positions)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ref.cpu(), oracle, atol=atol, rtol=rtol)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # The mask matters: the bidirectional result differs for every block-causal request.
    plain = paged_attention_ref(q, kc, vc, cu, bt, kvl, scale)
    assert not torch.allclose(plain[:8], ref[:8])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_per_row_key_bounds(device, dtype, num_splits):
    """DiffusionGemma's masks: each query sees keys [lo, hi) — an encoder row causally (in a
    sliding window or from 0), a canvas row the canvas and what precedes it (windowed or
    not); a row with no keys outputs 0. GQA, KV splits, a window starting mid-tile."""
    query_lens, kv_lens = [9, 16, 4], [40, 37, 12]
    q, kc, vc, cu, bt, kvl = make_batch(query_lens, kv_lens, 8, 2, 16, 8, device, dtype)
    g = torch.Generator().manual_seed(4)
    lo, hi = [], []
    for n, kv in zip(query_lens, kv_lens):
        for _ in range(n):
            a = int(torch.randint(0, kv, (1,), generator=g))
            lo.append(a)
            hi.append(int(torch.randint(a + 1, kv + 1, (1,), generator=g)))
    lo[3], hi[3] = 5, 5  # no keys at all
    bounds = (torch.tensor(lo, dtype=torch.int32, device=device),
              torch.tensor(hi, dtype=torch.int32, device=device))
    scale = 16 ** -0.5
    out = paged_attention(q, kc, vc, cu, bt, kvl, scale, num_splits=num_splits,
                          key_bounds=bounds)
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, scale, key_bounds=bounds)
    oracle = torch.zeros_like(q.cpu())
    cuts = cu.tolist()
    for r in range(len(query_lens)):
        pages = bt[r, :-(-kv_lens[r] // 8)].long().cpu()
        keys = kc.cpu()[pages].flatten(0, 1).double()
        vals = vc.cpu()[pages].flatten(0, 1).double()
        for i in range(cuts[r], cuts[r + 1]):
            if lo[i] == hi[i]:
                continue
            k = keys[lo[i]:hi[i]].repeat_interleave(4, 1)
            v = vals[lo[i]:hi[i]].repeat_interleave(4, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q.cpu()[i].double(), k) * scale, -1)
            oracle[i] = torch.einsum("hk,khd->hd", w, v).to(q.dtype)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ref.cpu(), oracle, atol=atol, rtol=rtol)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    assert not ref[3].any()


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("d,hq,hkv", [(64, 4, 2), (256, 4, 2), (512, 4, 1)],
                         ids=["d64-gqa2", "d256-gqa2", "d512-gqa4"])
@pytest.mark.parametrize("window", [6, 1 << 20], ids=["sliding", "full"])
def test_canvas_forwards_of_diffusion_gemma(device, dtype, d, hq, hkv, window):
    """DiffusionGemma's forwards as the engine packs them (``canvas_key_bounds``): a prompt's
    encoder rows and its first canvas (decoder rows); a finished canvas's encoder rows and the
    next canvas; a canvas step alone — windowed (sliding layers, window shorter than the
    prefix) and full, head dims 64 to 512 (the full layers'), GQA, shuffled page tables, with
    and without KV splits: the kernel equals the reference."""
    from sangam.models.diffusion_gemma import canvas_key_bounds

    canvas = 8
    # (encoder rows' first position, number of encoder rows, canvas start) per request
    layout = [(0, 13, 13), (13, 8, 21), (None, 0, 29)]
    positions, starts, ends, query_lens, kv_lens = [], [], [], [], []
    for first, n_enc, s in layout:
        enc = [] if first is None else list(range(first, first + n_enc))
        positions += enc + list(range(s, s + canvas))
        starts += [0] * len(enc) + [s] * canvas
        ends += [0] * len(enc) + [s + canvas] * canvas
        query_lens.append(len(enc) + canvas)
        kv_lens.append(s + canvas)
    lo, hi, wlo = canvas_key_bounds(np.array(positions), np.array(starts), np.array(ends),
                                    window)
    first = lo if window > 1000 else wlo
    q, kc, vc, cu, bt, kvl = make_batch(query_lens, kv_lens, hq, hkv, d, 8, device, dtype,
                                        seed=d + window)
    bounds = (torch.from_numpy(first).to(device), torch.from_numpy(hi).to(device))
    scale = d ** -0.5
    ref = paged_attention_ref(q, kc, vc, cu, bt, kvl, scale, key_bounds=bounds)
    for splits in (1, 2):
        out = paged_attention(q, kc, vc, cu, bt, kvl, scale, num_splits=splits,
                              key_bounds=bounds)
        torch.testing.assert_close(out, ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    if window < 1000:  # the window matters: some row sees fewer keys than the full layer's
        assert (wlo > lo).any()
