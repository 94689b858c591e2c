"""pytest-benchmark timings of the Triton kernels at one representative shape each (CUDA only).

Run: ``PYTHONPATH=. python -m pytest microbench/test_bench_kernels.py`` (add
``--benchmark-json microbench/results/bench.json`` to keep the numbers). The full sweep with
GB/s, TFLOP/s and baselines is ``sangam-bench kernels``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("pytest_benchmark")
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("kernel timings need a CUDA GPU (and TRITON_INTERPRET unset)",
                allow_module_level=True)

from sangam.bench.kernels import MODELS, MOE_MODELS, PAGE, VOCAB, _paged_batch  # noqa: E402
from sangam.kernels import (  # noqa: E402
    fused_moe,
    fused_score,
    gather_pages,
    paged_attention,
    store_kv,
)


def _timed(benchmark, fn):
    def call():
        fn()
        torch.cuda.synchronize()

    fn()  # compile outside the timing
    torch.cuda.synchronize()
    benchmark.pedantic(call, rounds=50, warmup_rounds=5)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batch,q_len,kv", [(16, 32, 2048), (1, 32, 4096), (1, 2048, 2048)],
                         ids=["cached-b16", "cached-b1-split", "refresh-2048"])
def test_paged_attention(benchmark, model, batch, q_len, kv):
    hq, hkv, d, _ = MODELS[model]
    q, kc, vc, cu, table, kv_lens = _paged_batch(batch, q_len, kv, hq, hkv, d, "cuda",
                                                 torch.bfloat16)
    _timed(benchmark, lambda: paged_attention(q, kc, vc, cu, table, kv_lens, d ** -0.5,
                                              max_query_len=q_len))


@pytest.mark.parametrize("model", list(MODELS))
def test_store_kv(benchmark, model):
    _, hkv, d, _ = MODELS[model]
    n = 2048
    k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(n // PAGE, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(n, device="cuda")
    _timed(benchmark, lambda: store_kv(k, k, cache, cache.clone(), slots))


@pytest.mark.parametrize("rows", [32, 2048])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_score(benchmark, rows, temperature):
    dev = "cuda"
    logits = 3 * torch.randn(rows, VOCAB, device=dev, dtype=torch.bfloat16)
    temperatures = torch.full((rows,), temperature, device=dev, dtype=torch.float64)
    keys = torch.randint(0, 2**32, (rows,), device=dev)
    _timed(benchmark, lambda: fused_score(logits, VOCAB - 128, temperatures, keys))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("requests", [1, 8])
def test_gather_pages(benchmark, model, requests):
    _, hkv, d, layers = MODELS[model]
    n = requests * 64  # 1024-token requests
    pool = torch.randn(layers, 2, n + 16, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(n + 16, device="cuda")[:n]
    _timed(benchmark, lambda: gather_pages(pool, ids))


def _route(tokens, moe):
    logits = torch.randn(tokens, moe.experts, device="cuda")
    bias = 0.1 * torch.randn(moe.experts, device="cuda")
    return lambda: moe.route(logits, bias)


@pytest.mark.parametrize("tokens", [64, 2048])
def test_moe_route(benchmark, tokens):
    _timed(benchmark, _route(tokens, MOE_MODELS["llada2-mini"]))


@pytest.mark.parametrize("model", list(MOE_MODELS))
@pytest.mark.parametrize("tokens", [64, 2048], ids=["decode-2x32", "prefill-2048"])
def test_fused_moe(benchmark, model, tokens):
    moe = MOE_MODELS[model]
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(moe.experts, 2 * moe.inter, moe.hidden, **bf16) * moe.hidden ** -0.5
    w2 = torch.randn(moe.experts, moe.hidden, moe.inter, **bf16) * moe.inter ** -0.5
    x = torch.randn(tokens, moe.hidden, **bf16)
    weights, ids = _route(tokens, moe)()
    _timed(benchmark, lambda: fused_moe(x, w13, w2, weights, ids, activation=moe.activation))
