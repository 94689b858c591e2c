"""Every serving-shape kernel launch compiles for the H200 (sm_90) without a GPU.

`sangam-bench kernels` on a machine without CUDA runs the interpreter correctness pass and then
cross-compiles each launch of its suites with Triton's ptxas. The interpreter cannot see code
generation failures, register spills, shared memory over the chip's limit, or loads the
compiler could not vectorize; this can.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from sangam.kernels.cross_compile import H200, TARGETS

MEMORY_BOUND = {"_attn_kernel", "_store_kv_kernel", "_page_copy_kernel", "_score_kernel",
                "_store_kv_fp8_kernel"}
KERNELS = {"_attn_kernel", "_merge_splits_kernel", "_store_kv_kernel", "_page_copy_kernel",
           "_score_kernel", "_merge_kernel", "_route_kernel", "_gate_up_kernel", "_down_kernel",
           "_combine_kernel", "_fp8_gemm_kernel", "_store_kv_fp8_kernel"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU path times instead")
def test_serving_launches_compile_for_h200_without_spills(tmp_path):
    out = tmp_path / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "sangam.bench.cli", "kernels", "--quick",
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cpu_selfcheck"] and all(c["ok"] for c in report["cpu_selfcheck"])
    builds = report["cross_compile"]["builds"]
    assert builds is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {b["kernel"] for b in builds} == KERNELS
    # Cached steps (32-query tiles) and refreshes (128-query tiles), with and without split-KV.
    attn = {(b["constants"]["BLOCK_M"], b["constants"]["SPLIT"]) for b in builds
            if b["kernel"] == "_attn_kernel" and b["constants"]["BLOCK_D"] == "128"}
    assert attn == {("32", "True"), ("32", "False"), ("128", "True"), ("128", "False")}
    # DiffusionGemma's canvases: per-row key bounds at its sliding layers' 256-wide heads and
    # its full layers' 512-wide ones, tiles chosen to stay unspilled (checked below).
    assert {b["constants"]["BLOCK_D"] for b in builds if b["kernel"] == "_attn_kernel"
            and b["constants"]["ROW_BOUNDS"] == "True"} == {"256", "512"}
    # SDAR's block-causal mask compiles for cached steps and prefills alike.
    assert {b["constants"]["BLOCK_M"] for b in builds if b["kernel"] == "_attn_kernel"
            and b["constants"]["BLOCK_CAUSAL"] == "True"} == {"32", "128"}
    # Refresh tiles (compute-bound) run on Hopper's asynchronous tensor-core instructions.
    assert {b["mma"] for b in builds
            if b["kernel"] == "_attn_kernel" and b["constants"]["BLOCK_M"] == "128"} == {"wgmma"}
    # LLaDA2's experts: 16-row tiles for decode steps, 64-row ones for a 2048-token step; Gemma
    # 4's GeGLU experts compile too.
    assert {b["constants"]["BLOCK_M"] for b in builds if b["kernel"] == "_gate_up_kernel"
            and b["constants"]["GELU_TANH"] == "False"} == {"16", "64"}
    assert any(b["constants"].get("GELU_TANH") == "True" for b in builds)
    # FP8: the GEMM and both expert GEMMs on FP8 tensor-core instructions.
    fp8 = [b for b in builds if b["kernel"] == "_fp8_gemm_kernel"
           or b["constants"].get("FP8") == "True"]
    assert {b["kernel"] for b in fp8} == {"_fp8_gemm_kernel", "_gate_up_kernel", "_down_kernel"}
    assert all(b["mma"] != "none" for b in fp8)
    # The FP8 KV cache: attention over FP8 pages for cached steps and refreshes.
    assert {b["constants"]["BLOCK_M"] for b in builds if b["kernel"] == "_attn_kernel"
            and b["constants"]["FP8_KV"] == "True"} == {"32", "128"}
    for b in builds:
        assert b["spill_bytes"] == 0, b["text"]
        assert b["shared_bytes"] <= H200.max_shared_bytes, b["text"]
        assert 0 < b["registers"] <= 255, b["text"]
        if b["kernel"] in MEMORY_BOUND:  # they stream K/V pages or logits: 16-byte loads
            assert b["wide_loads"] > 0, b["text"]
    assert "no register spills" in proc.stdout


_WIDE_DTYPES = """
import dataclasses, json, sys, torch
from sangam.kernels import paged_attention
from sangam.kernels.cross_compile import TARGETS, cross_compiling

meta = torch.device("meta")
i32 = dict(dtype=torch.int32, device=meta)
out = []
for target in ("H200", "A100"):
    with cross_compiling(TARGETS[target]) as builds:
        for dtype in (torch.float32, torch.float64):
            for d in (128, 256):
                for group, q_len in ((7, 32), (1, 1024)):  # a Dream step, a refresh
                    q = torch.empty(q_len, group * 2, d, dtype=dtype, device=meta)
                    kc = torch.empty(128, 16, 2, d, dtype=dtype, device=meta)
                    paged_attention(q, kc, kc, torch.empty(2, **i32),
                                    torch.empty(1, 128, **i32), torch.empty(1, **i32), 0.1,
                                    max_query_len=q_len)
    out += [dataclasses.asdict(b) | {"target": target, "text": b.describe()} for b in builds]
json.dump(out, sys.stdout, default=str)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU launches these for real")
def test_wide_dtype_attention_fits_shared_memory():
    """fp32 and fp64 (the exact-test dtype) hold two or four times the bytes per tile of bf16:
    the launch shrinks its pipeline, K/V tiles or query tiles to fit the chip's shared memory
    (227 KiB per program on the H200, 163 KiB on the A100)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _WIDE_DTYPES], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = json.loads(proc.stdout)
    assert {b["constants"]["ACC_DTYPE"] for b in builds} == {"fp32", "fp64"}
    assert {b["target"] for b in builds} == {"H200", "A100"}
    for b in builds:
        assert b["shared_bytes"] <= TARGETS[b["target"]].max_shared_bytes, b["text"]


_GEMMA_HEADS = """
import dataclasses, json, sys, torch
from sangam.kernels import paged_attention
from sangam.kernels.cross_compile import TARGETS, cross_compiling

meta = torch.device("meta")
i32 = dict(dtype=torch.int32, device=meta)
with cross_compiling(TARGETS["H200"]) as builds:
    for q_len in (1, 256, 512):  # a short step; a canvas; a finished canvas and the next
        for bounded in (False, True):
            q = torch.empty(q_len, 16, 512, dtype=torch.bfloat16, device=meta)
            kc = torch.empty(128, 16, 2, 512, dtype=torch.bfloat16, device=meta)
            bounds = (torch.empty(q_len, **i32),) * 2 if bounded else None
            paged_attention(q, kc, kc, torch.empty(2, **i32), torch.empty(1, 128, **i32),
                            torch.empty(1, **i32), 1.0, max_query_len=q_len, key_bounds=bounds)
json.dump([dataclasses.asdict(b) | {"text": b.describe()} for b in builds], sys.stdout,
          default=str)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU launches these for real")
def test_gemma_heads_compile_for_h200_without_spills():
    """DiffusionGemma's full layers: 512-wide heads (GQA 8), with and without per-query key
    bounds, in one tile of the head dim without register spills or too much shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _GEMMA_HEADS], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    builds = [b for b in json.loads(proc.stdout) if b["kernel"] == "_attn_kernel"]
    assert {str(b["constants"]["ROW_BOUNDS"]) for b in builds} == {"True", "False"}
    for b in builds:
        assert str(b["constants"]["BLOCK_D"]) == "512"
        assert b["spill_bytes"] == 0 and b["shared_bytes"] <= H200.max_shared_bytes, b["text"]
