"""The FP8 linear kernel vs its PyTorch reference (docs/design.md §5.6), and the reference
against the ecosystem's: transformers' and compressed-tensors' dequantization of the same
FP8 values and scales.

CPU tensors under the Triton interpreter: kernel and reference quantize the activations to
the same FP8 values and differ only in fp32 accumulation order. The last test compiles the
kernel for the H200 at LLaDA-8B's projection shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sangam.kernels.cross_compile import H200
from sangam.kernels.fp8_gemm import fp8_linear
from sangam.kernels.reference import (
    FP8_ACTIVATIONS,
    FP8_MAX,
    dequantize_fp8_ref,
    fp8_linear_ref,
    quantize_fp8_groups_ref,
)
from sangam.models import config as model_config

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CPU = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")
_GPU = [pytest.mark.gpu, pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(),
                                             reason="needs CUDA (not interpreted)")]


def _weights(n: int, k: int, block: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 150).clamp(-FP8_MAX, FP8_MAX)
    shape = (-(-n // 128), -(-k // 128)) if block else (n,)
    return w.to(torch.float8_e4m3fn), torch.rand(shape, generator=gen) * 0.01 + 1e-3


def test_activation_modes_are_one_list():
    assert model_config.FP8_ACTIVATIONS == FP8_ACTIVATIONS


@_CPU
@pytest.mark.parametrize("m,n,k", [(1, 40, 200), (7, 130, 256), (33, 64, 129), (5, 3, 17),
                                   (0, 16, 128)])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("activation", FP8_ACTIVATIONS)
def test_kernel_equals_reference(m, n, k, block, activation):
    """Odd shapes, one token, an empty batch; per-channel and 128 x 128 block weight scales;
    every activation mode; a bias."""
    w, ws = _weights(n, k, block, seed=m + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 4
    x[:, :3] = 0.0  # an all-zero group start: its scale stays finite
    bias = torch.randn(n, generator=gen)
    xs = torch.tensor([0.03])
    kw = dict(activation=activation, input_scale=xs, block_weights=block, bias=bias)
    got, want = fp8_linear(x, w, ws, **kw), fp8_linear_ref(x, w, ws, **kw)
    assert got.shape == want.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("m", [1, 32, 300])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("activation", FP8_ACTIVATIONS)
@pytest.mark.parametrize("_gpu", [pytest.param(0, marks=_GPU)])
def test_kernel_on_cuda_in_bf16(m, block, activation, _gpu):
    """The compiled kernel (mma.sync and wgmma tiles) against the reference, bf16 x."""
    w, ws = _weights(384, 520, block, seed=m)
    x = (torch.randn(m, 520) * 4).to(torch.bfloat16)
    kw = dict(activation=activation, input_scale=torch.tensor([0.03]), block_weights=block)
    want = fp8_linear_ref(x, w, ws, **kw)
    got = fp8_linear(x.cuda(), w.cuda(), ws.cuda(), **{**kw, "input_scale":
                                                       kw["input_scale"].cuda()})
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2,
                               atol=2e-2 * float(want.abs().max()))


@_CPU
def test_kernel_takes_leading_dims_and_bf16():
    w, ws = _weights(96, 160, block=True)
    x = torch.randn(2, 3, 160).to(torch.bfloat16)
    got = fp8_linear(x, w, ws, block_weights=True)
    want = fp8_linear_ref(x, w, ws, block_weights=True)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 96)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@_CPU
def test_kernel_rounds_like_torch():
    """The kernel's FP8 rounding (nearest, ties to even; subnormals; the largest value) gives
    torch's float8_e4m3fn values: weights of ones read back each activation's FP8 value."""
    # Every e4m3 value, the midpoints between neighbours (ties) and points near them.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids * (1 + 1e-6), mids * (1 - 1e-6)])
    vals = vals[vals.abs() <= FP8_MAX]
    k = 128
    x = torch.nn.functional.pad(vals, (0, -len(vals) % k)).view(-1, k)
    x[:, -1] = FP8_MAX  # each group's amax is 448: its scale is exactly 1
    eye = torch.eye(k).to(torch.float8_e4m3fn)
    got = fp8_linear(x, eye, torch.ones(k), activation="dynamic")
    torch.testing.assert_close(got, x.to(torch.float8_e4m3fn).float(), rtol=0, atol=0)
    q, s = quantize_fp8_groups_ref(x)
    assert torch.equal(s, torch.ones_like(s)) and torch.equal(q.float(), got)


def test_dequantization_equals_transformers_and_compressed_tensors():
    """The reference's dequantized weights equal transformers' (FineGrainedFP8, 128 x 128
    blocks, a ragged edge) and compressed-tensors' (per channel, per tensor)."""
    pytest.importorskip("compressed_tensors", reason="a dev dependency (make install)")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w, blocks = _weights(300, 200, block=True)
    theirs = _dequantize_fp8_weight(w, blocks, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_ref(w, blocks, torch.float32, block=True), theirs)
    for strategy, scale in (("channel", torch.rand(300, 1) + 0.1),
                            ("tensor", torch.rand(1) + 0.1)):
        args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True)
        theirs = dequantize(w, scale, args=args, dtype=torch.float32)
        assert torch.equal(dequantize_fp8_ref(w, scale, torch.float32, block=False), theirs)


def _experts(e: int, h: int, i: int, block: bool, seed: int):
    """FP8 w13 (gate rows then up rows) and w2 with their scales, as SparseMoe stacks them."""
    gate, sg = _weights(e * i, h, block, seed)
    up, su = _weights(e * i, h, block, seed + 1)
    down, sd = _weights(e * h, i, block, seed + 2)
    w13 = torch.cat([gate.view(e, i, h), up.view(e, i, h)], dim=1)
    w2 = down.view(e, h, i)
    if block:  # each expert its own blocks: rescale per expert
        gen = torch.Generator().manual_seed(seed)
        bi, bh = -(-i // 128), -(-h // 128)
        s13 = torch.rand(e, 2 * bi, bh, generator=gen) * 0.01 + 1e-3
        s2 = torch.rand(e, bh, bi, generator=gen) * 0.01 + 1e-3
    else:
        s13 = torch.cat([sg.view(e, i), su.view(e, i)], dim=1)
        s2 = sd.view(e, h)
    return w13, w2, s13, s2


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=_CPU),
                                    pytest.param("cuda", marks=_GPU)])
@pytest.mark.parametrize("t,h,i,e,k", [(1, 128, 128, 4, 2), (9, 200, 96, 6, 2),
                                       (17, 256, 320, 8, 3), (5, 64, 48, 8, 1)])
@pytest.mark.parametrize("block", [False, True])
def test_fp8_fused_moe_equals_reference(t, h, i, e, k, block, device):
    """Odd widths (gate/up halves not on 128-edges), one token, experts nobody picks, and
    experts held by another rank (ids == E, expert parallelism)."""
    from sangam.kernels import fused_moe, fused_moe_ref

    w13, w2, s13, s2 = _experts(e, h, i, block, seed=t + h)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen) * 3
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    kw = dict(w13_scale=s13, w2_scale=s2, block_weights=block)
    held = ids.masked_fill(ids == 0, e)  # expert 0 held elsewhere
    on = {name: t.to(device) for name, t in dict(w13=w13, w2=w2, weights=weights).items()}
    kw_on = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kw.items()}
    x_on = x.to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    for route, partial in ((ids, False), (held, True)):
        got = fused_moe(x_on, on["w13"], on["w2"], on["weights"], route.to(device),
                        partial=partial, **kw_on).cpu().float()
        want = fused_moe_ref(x_on.cpu(), w13, w2, weights, route, partial=partial, **kw).float()
        # The intermediate is quantized after fp32 sums in another order: now and then one
        # of its values rounds to the neighbouring FP8 value (1/16 of it) in one of the two.
        tol = 1e-5 if device == "cpu" else 2e-2
        torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))


_COMPILE = """
import dataclasses, json, sys, torch
from sangam.kernels.fp8_gemm import fp8_linear
from sangam.kernels.cross_compile import cross_compiling

meta = torch.device("meta")
def empty(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device=meta)
out = []
for n, k in ((4096, 4096), (4096, 12288)):  # LLaDA-8B's attention and down projections
    for tokens in (16, 1024):
        for act in ("dynamic", "static", "none"):
            for block in (True, False):
                scale = empty(n // 128, k // 128) if block else empty(n)
                with cross_compiling() as builds:
                    fp8_linear(empty(tokens, k), empty(n, k, dtype=torch.float8_e4m3fn),
                               scale.float(), activation=act,
                               input_scale=empty(1, dtype=torch.float32), block_weights=block)
                out += [dataclasses.asdict(b) | {"tokens": tokens, "text": b.describe()}
                        for b in builds]
from sangam.kernels import fused_moe, moe_route
for tokens in (64, 2048):  # LLaDA2.0-flash's experts: decode and prefill
    for block in (True, False):
        with cross_compiling() as builds:
            w, ids = moe_route(empty(tokens, 256), top_k=8, score="sigmoid",
                               bias=empty(256, dtype=torch.float32), n_group=8, topk_group=4)
            fp8 = torch.float8_e4m3fn
            s13 = empty(256, 16, 32) if block else empty(256, 2048)
            s2 = empty(256, 32, 8) if block else empty(256, 4096)
            fused_moe(empty(tokens, 4096), empty(256, 2048, 4096, dtype=fp8),
                      empty(256, 4096, 1024, dtype=fp8), w, ids, w13_scale=s13.float(),
                      w2_scale=s2.float(), block_weights=block)
        out += [dataclasses.asdict(b) | {"tokens": tokens, "moe": True, "text": b.describe()}
                for b in builds if "gate_up" in b.kernel or "down" in b.kernel]
json.dump(out, sys.stdout, default=str)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU launches these for real")
def test_fp8_kernels_compile_for_h200_without_spills():
    """The FP8 GEMM at decode (16 tokens: mma.sync tiles) and prefill sizes (1024: wgmma) in
    every mode, and the FP8 fused MoE's two GEMMs at LLaDA2.0-flash's expert shapes: no
    spills, within the H200's shared memory, FP8 operands on the tensor cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = json.loads(proc.stdout)
    gemms = [b for b in builds if not b.get("moe")]
    assert len(gemms) == 24 and len(builds) == 32
    for b in builds:
        assert b["spill_bytes"] == 0, b["text"]
        assert b["shared_bytes"] <= H200.max_shared_bytes, b["text"]
        assert 0 < b["registers"] <= 255, b["text"]
        assert b["mma"] != "none", b["text"]
    for b in gemms:
        assert b["mma"] == ("wgmma" if b["tokens"] == 1024 else "mma.sync"), b["text"]
