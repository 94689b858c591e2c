"""The FP8 KV cache's kernels vs their references (docs/design.md §5, items 1-2): the store
writes the same bytes as ``store_kv_ref`` (each row's head scaled by its amax / 448, rounded
to nearest even, the scale after the values), and paged attention over FP8 pages equals
``paged_attention_ref`` (GQA, pages out of order, split KV, the block-causal mask and
per-query key bounds), fp32 and fp64, under the interpreter; bf16 on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from sangam.kernels import paged_attention, paged_attention_ref, store_kv, store_kv_ref
from sangam.kernels.reference import FP8_MAX, quantize_kv_ref
from sangam.models.attention import PagedKV
from sangam.models.config import ModelConfig

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(not INTERPRET, reason="CPU "
                 "tensors need TRITON_INTERPRET=1"), id="cpu-fp32"),
    pytest.param("cpu", torch.float64, marks=pytest.mark.skipif(not INTERPRET, reason="CPU "
                 "tensors need TRITON_INTERPRET=1"), id="cpu-fp64"),
    pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (not interpreted)")],
        id="cuda-bf16"),
]


def _pool(device, dtype, heads=2, d=32, pages=12, page_size=16) -> PagedKV:
    cfg = ModelConfig(architecture="LLaDAModelLM", hidden_size=4 * d, num_layers=1,
                      num_heads=4, num_kv_heads=heads, intermediate_size=8, vocab_size=4,
                      mask_token_id=3, eos_token_id=1, rope_theta=1e4, rms_norm_eps=1e-5,
                      max_position=64, qkv_bias=False, shift_logits=False)
    return PagedKV.for_model(cfg, pages, page_size, dtype, device, fp8=True)


def test_the_pool_layout_holds_values_then_scales():
    kv = _pool("cpu", torch.float32)
    # 16 token rows of 2 heads x 32 values, then 2 rows holding their 16 x 2 fp32 scales.
    assert kv.buffers[0].dtype == torch.uint8 and kv.buffers[0].shape == (1, 2, 12, 18, 2, 32)
    assert kv.k[0].dtype == torch.float8_e4m3fn and kv.k[0].shape == (12, 16, 2, 32)
    assert kv.k[0].stride() == (18 * 64, 64, 32, 1) and kv.page_size == 16
    assert kv.k_scales[0].dtype == torch.float32 and kv.k_scales[0].shape == (12, 16, 2)
    kv.k_scales[0][5, 3, 1] = 2.5  # token 3, head 1: the 8th scale after the values
    scales = kv.buffers[0][0, 0, 5, 16:].flatten()
    assert torch.equal(scales[28:32].view(torch.float32), torch.tensor([2.5]))
    assert kv.page_bytes() == 2 * 18 * 2 * 32


@pytest.mark.parametrize("device,dtype", CASES)
def test_store_writes_the_references_bytes(device, dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = _pool(device, dtype), _pool(device, dtype)
    k = (torch.randn(37, 2, 32, generator=gen) * 7).to(device, dtype)
    v = torch.randn(37, 2, 32, generator=gen).to(device, dtype)
    k[3] = 0.0  # an all-zero row: its scale stays finite
    slots = torch.randperm(12 * 16, generator=gen)[:37].to(device)
    slots[5] = -1  # a padded row: skipped
    store_kv(k, v, a.k[0], a.v[0], slots, a.k_scales[0], a.v_scales[0])
    store_kv_ref(k, v, b.k[0], b.v[0], slots, b.k_scales[0], b.v_scales[0])
    assert torch.equal(a.buffers[0], b.buffers[0])


def test_quantized_rows_round_like_torch():
    x = torch.randn(50, 3, 64) * 10
    q, s = quantize_kv_ref(x)
    assert torch.equal(q, (x / s[..., None]).to(torch.float8_e4m3fn))
    assert torch.allclose(q.float().abs().amax(-1), torch.full((50, 3), FP8_MAX))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("variant", ["plain", "splits", "causal", "bounds"])
def test_attention_over_fp8_pages_equals_reference(device, dtype, variant):
    gen = torch.Generator().manual_seed(1)
    kv = _pool(device, dtype)
    table = torch.tensor([[3, 7, 1, 0], [11, 2, 5, 9]], dtype=torch.int32, device=device)
    kv_lens = torch.tensor([50, 37], dtype=torch.int32, device=device)
    slots = torch.cat([(table[r, :4].long()[:, None] * 16 + torch.arange(16, device=device)
                        ).flatten()[:n] for r, n in enumerate((50, 37))])
    k = (torch.randn(87, 2, 32, generator=gen) * 3).to(device, dtype)
    v = torch.randn(87, 2, 32, generator=gen).to(device, dtype)
    store_kv_ref(k, v, kv.k[0], kv.v[0], slots, kv.k_scales[0], kv.v_scales[0])
    q = torch.randn(13, 4, 32, generator=gen).to(device, dtype)
    cu = torch.tensor([0, 8, 13], dtype=torch.int32, device=device)
    kw = {}
    if variant == "splits":
        kw["num_splits"] = 3
    if variant == "causal":
        kw = dict(causal_blocks=torch.tensor([4, 8], dtype=torch.int32, device=device),
                  positions=torch.cat([torch.arange(42, 50), torch.arange(30, 35)]).to(device))
    if variant == "bounds":
        lo = torch.tensor([0] * 8 + [10] * 5, dtype=torch.int32, device=device)
        hi = torch.tensor([45] * 8 + [37] * 5, dtype=torch.int32, device=device)
        kw["key_bounds"] = (lo, hi)
    scales = dict(k_scales=kv.k_scales[0], v_scales=kv.v_scales[0])
    got = paged_attention(q, kv.k[0], kv.v[0], cu, table, kv_lens, 0.2, **kw, **scales)
    ref_kw = {k2: v2 for k2, v2 in kw.items() if k2 != "num_splits"}
    want = paged_attention_ref(q, kv.k[0], kv.v[0], cu, table, kv_lens, 0.2, **ref_kw,
                               **scales)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_fp8_pages_without_their_scales_are_refused():
    """Read or written without its scales an FP8 page would be garbage: every entry point
    refuses."""
    from sangam.kernels import store_kv_rope

    kv = _pool("cpu", torch.float32)
    k = torch.randn(3, 2, 32)
    slots = torch.tensor([0, 1, 2])
    cu, table = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    for call in (lambda: store_kv_ref(k, k, kv.k[0], kv.v[0], slots),
                 lambda: store_kv(k, k, kv.k[0], kv.v[0], slots),
                 lambda: store_kv_rope(k, k, kv.k[0], kv.v[0], slots, slots,
                                       torch.ones(4, 32), torch.ones(4, 32)),
                 lambda: paged_attention_ref(torch.randn(3, 4, 32), kv.k[0], kv.v[0], cu,
                                             table, lens, 0.2),
                 lambda: paged_attention(torch.randn(3, 4, 32), kv.k[0], kv.v[0], cu, table,
                                         lens, 0.2)):
        with pytest.raises(ValueError, match="FP8"):
            call()
