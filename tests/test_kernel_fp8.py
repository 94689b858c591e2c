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
json.dump(out, sys.stdout, default=str)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU launches these for real")
def test_fp8_kernel_compiles_for_h200_without_spills():
    """Decode-sized (16 tokens: mma.sync tiles) and prefill-sized (1024: wgmma) launches in
    every mode: no spills, within the H200's shared memory; FP8 operands on the tensor
    cores."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = json.loads(proc.stdout)
    assert len(builds) == 24
    for b in builds:
        assert b["spill_bytes"] == 0, b["text"]
        assert b["shared_bytes"] <= H200.max_shared_bytes, b["text"]
        assert 0 < b["registers"] <= 255, b["text"]
        assert b["mma"] == ("wgmma" if b["tokens"] == 1024 else "mma.sync"), b["text"]
