"""Page gather/scatter kernel vs its PyTorch reference (CPU interpreter, and CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

from sangam.kernels.page_copy import gather_pages, scatter_pages
from sangam.kernels.reference import gather_pages_ref, layer_indices, scatter_pages_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(
        not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cpu", torch.float64, marks=pytest.mark.skipif(
        not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, pytest.mark.skipif(
        INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (not interpreted)")]),
]


def _pool(device, dtype, layers=3, pages=9, page_size=4, hkv=3, d=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(layers, 2, pages, page_size, hkv, d, generator=g).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("layers", [None, slice(1, 3), range(0, 3, 2), slice(None, None, -1)])
def test_gather_matches_reference(device, dtype, layers):
    pool = _pool(device, dtype)
    ids = torch.tensor([7, 0, 3, 8], dtype=torch.int32, device=device)
    out = gather_pages(pool, ids, layers)
    assert out.is_contiguous()
    assert torch.equal(out, gather_pages_ref(pool, ids, layers))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("layers", [None, slice(2, 3)])
def test_scatter_matches_reference(device, dtype, layers):
    pool = _pool(device, dtype)
    expect = pool.clone()
    ids = torch.tensor([5, 1, 6], dtype=torch.int64, device=device)
    n_layers = len(range(pool.shape[0])[layers or slice(None)])
    buf = torch.randn(n_layers, 2, 3, *pool.shape[3:]).to(device, dtype)
    scatter_pages(buf, pool, ids, layers)
    scatter_pages_ref(buf, expect, ids, layers)
    assert torch.equal(pool, expect)


@pytest.mark.parametrize("device,dtype", CASES[:1] + CASES[2:])
def test_round_trip_between_pools(device, dtype):
    """Gather from one pool, scatter into other page numbers of another: the transfer path."""
    src = _pool(device, dtype, page_size=16, hkv=3, d=16)  # 768 elements: a masked block
    dst = torch.zeros_like(src)
    buf = gather_pages(src, torch.tensor([2, 4], device=device))
    scatter_pages(buf, dst, torch.tensor([8, 0], device=device))
    assert torch.equal(dst[:, :, 8], src[:, :, 2]) and torch.equal(dst[:, :, 0], src[:, :, 4])
    assert not dst[:, :, 1:8].any()


def test_empty_page_list():
    pool = torch.zeros(2, 2, 3, 4, 1, 8)
    out = gather_pages(pool, torch.zeros(0, dtype=torch.int64))
    assert out.shape == (2, 2, 0, 4, 1, 8)


@pytest.mark.parametrize("layers", [None, slice(1, 3), range(0, 3, 2), slice(None, None, -1),
                                    slice(None, None, -2), range(2, 2)])
def test_reference_gather_is_the_definition(layers):
    """The reference reads only the pages asked for (a view of the layers, one copy of the
    pages), and equals the plain definition: every selected layer's pool, then the pages."""
    pool = _pool("cpu", torch.float64, layers=4)
    ids = torch.tensor([7, 0, 3], dtype=torch.int32)
    chosen = torch.tensor(list(layer_indices(pool.shape[0], layers)), dtype=torch.int64)
    assert torch.equal(gather_pages_ref(pool, ids, layers), pool[chosen][:, :, ids.long()])
