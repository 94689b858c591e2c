"""KV store kernel vs its PyTorch reference (CPU interpreter, and CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

from sangam.kernels.kv_store import store_kv, store_kv_rope
from sangam.kernels.reference import store_kv_ref, store_kv_rope_ref
from sangam.models.attention import PagedKV
from sangam.models.transformer import RotaryEmbedding

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(
        not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cpu", torch.float64, marks=pytest.mark.skipif(
        not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (not interpreted)")]),
]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("page_size,hkv,d", [(4, 2, 8), (16, 3, 16), (8, 1, 64)])
def test_store_matches_reference(device, dtype, page_size, hkv, d):
    g = torch.Generator().manual_seed(page_size + hkv)
    pages = 5
    n = 11
    k = torch.randn(n, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(n, hkv, d, generator=g).to(device, dtype)
    # Distinct slots spread over pages, crossing page boundaries, some skipped.
    slots = torch.randperm(pages * page_size, generator=g)[:n]
    slots[[2, 7]] = -1
    slots = slots.to(device)
    kc = torch.randn(pages, page_size, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(pages, page_size, hkv, d, generator=g).to(device, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("device,dtype", CASES[:1] + CASES[2:])
def test_store_into_paged_kv_layer_views(device, dtype):
    """The caches are strided views of one layer of the shared pool; other layers stay put."""
    kv = PagedKV.allocate(3, 4, 4, 2, 8, dtype, device)
    k = torch.randn(6, 2, 8).to(device, dtype)
    v = torch.randn(6, 2, 8).to(device, dtype)
    slots = torch.tensor([0, 1, 2, 3, 4, 13], device=device)
    store_kv(k, v, kv.k[1], kv.v[1], slots)
    flat_k = kv.buffer[1, 0].flatten(0, 1)
    flat_v = kv.buffer[1, 1].flatten(0, 1)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    assert kv.buffer[0].abs().sum() == 0 and kv.buffer[2].abs().sum() == 0
    assert flat_k.abs().sum() == k.abs().sum()


@pytest.mark.parametrize("device,dtype", CASES[:1] + CASES[2:])
def test_store_casts_to_cache_dtype(device, dtype):
    k = torch.randn(3, 1, 8, dtype=torch.float64).to(device)
    kc = torch.zeros(2, 4, 1, 8, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, -1, 0], device=device)
    store_kv(k, k, kc, vc, slots)
    assert torch.equal(kc.flatten(0, 1)[5], k[0].to(dtype))
    assert torch.equal(vc.flatten(0, 1)[0], k[2].to(dtype))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hkv,d", [(2, 16), (3, 8)])
def test_store_with_fused_rope(device, dtype, hkv, d):
    """K before RoPE, rotated on the way in, equals the model's RoPE followed by a plain store."""
    rope = RotaryEmbedding(d, 10000.0, max_positions=64)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    positions = torch.tensor([0, 3, 17, 40, 41, 5, 9], device=device)
    cos, sin = rope.table(cdt, positions.device)
    g = torch.Generator().manual_seed(d)
    k = torch.randn(7, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(7, hkv, d, generator=g).to(device, dtype)
    slots = torch.tensor([3, 0, -1, 9, 10, 15, 4], device=device)
    caches = [torch.zeros(4, 4, hkv, d, dtype=dtype, device=device) for _ in range(6)]
    store_kv_rope(k, v, caches[0], caches[1], slots, positions, cos, sin)
    store_kv_rope_ref(k, v, caches[2], caches[3], slots, positions, cos, sin)
    store_kv(rope.apply(k, *rope.cos_sin(positions, cdt)), v, caches[4], caches[5], slots)
    assert torch.equal(caches[1], caches[3]) and torch.equal(caches[3], caches[5])
    if device == "cpu":
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[2], caches[4])
    else:  # the GPU may fuse multiply-adds: 1 ulp of bf16
        torch.testing.assert_close(caches[0], caches[2], atol=2e-2, rtol=1e-2)
