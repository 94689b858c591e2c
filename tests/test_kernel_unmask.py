"""Fused confidence unmasking kernel vs score_logits + select_commits (its reference)."""

from __future__ import annotations

import os

import pytest
import torch

from sangam.decoding import RULE_IDS
from sangam.decoding.unmask_reference import unmask_ref
from sangam.kernels.unmask import fused_unmask

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
# Kernel configs: default; vocab split across programs; small vocab and rule tiles.
CONFIGS = [{}, {"num_splits": 3, "block_v": 32}, {"block_v": 64, "block_r": 4}]


def make_requests(rows, forced, rules, device, *, threshold=0.3, factor=1.0, k=2,
                  temperature=0.0):
    """Per-request tensors; scalars broadcast to every request."""
    n = len(rows)

    def per_req(x, dtype):
        vals = x if isinstance(x, list) else [x] * n
        return torch.tensor(vals, dtype=dtype, device=device)

    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(rows), 0)
    return dict(cu_rows=cu.to(device), num_forced=per_req(forced, torch.int32),
                rule=per_req([RULE_IDS[r] for r in rules], torch.int32),
                threshold=per_req(threshold, torch.float64),
                factor=per_req(factor, torch.float64), tokens_per_step=per_req(k, torch.int32),
                temperature=per_req(temperature, torch.float64))


def run_both(logits, mask_id, req, row_keys=None, **kw):
    if row_keys is None:
        g = torch.Generator().manual_seed(1)
        row_keys = torch.randint(0, 2**32, (logits.shape[0],), generator=g)
    row_keys = row_keys.to(logits.device)
    got = fused_unmask(logits, mask_id, row_keys=row_keys, **req, **kw)
    want = unmask_ref(logits, mask_id, row_keys=row_keys, **req)
    return got, want


def assert_same(got, want, logits_dtype):
    tokens, conf, commit = got
    rtokens, rconf, rcommit = want
    cdt = torch.float64 if logits_dtype == torch.float64 else torch.float32
    assert tokens.dtype == torch.int64 and conf.dtype == cdt and commit.dtype == torch.bool
    assert torch.equal(tokens, rtokens)
    # GPU fp32 exp is approximate (~2 ulp per term of the softmax sum).
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-5}[logits_dtype]
    torch.testing.assert_close(conf, rconf.to(cdt), atol=tol, rtol=tol)
    assert torch.equal(commit, rcommit)


def random_logits(m, v, device, dtype, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(m, v, generator=g)).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "vsplit", "small-tiles"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rules_forced_rows_and_empty_requests(device, dtype, config, temperature):
    # Vocab 300 is not a multiple of any chunk. Requests: threshold with a forced row, an empty
    # one, factor, topk with two forced rows, and one whose only row is forced (no candidates).
    rows = [5, 0, 6, 7, 1]
    logits = random_logits(sum(rows), 300, device, dtype)
    req = make_requests(rows, [1, 0, 0, 2, 1], ["threshold", "topk", "factor", "topk", "factor"],
                        device, temperature=temperature)
    got, want = run_both(logits, 299, req, **config)
    assert_same(got, want, dtype)
    commit = got[2].cpu()
    assert commit[0] and commit[11] and commit[12] and commit[18]  # forced rows
    assert commit[1:5].any() and commit[5:11].any() and commit[13:18].sum() == 2


@pytest.mark.parametrize("device,dtype", CASES)
def test_sampling_uses_the_hash_noise(device, dtype):
    """With temperature > 0 the kernel draws the reference's Gumbel noise, token for token."""
    logits = random_logits(24, 200, device, dtype, seed=3, spread=1.0)
    req = make_requests([24], 0, ["topk"], device, k=5, temperature=1.5)
    got, want = run_both(logits, 7, req, block_v=64)
    assert_same(got, want, dtype)
    assert not torch.equal(got[0], logits.float().argmax(1))  # the noise changed some tokens
    assert (got[0] != 7).all()


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rule", ["threshold", "factor", "topk"])
def test_confidence_ties_go_to_the_earlier_row(device, dtype, rule):
    # Rows 1, 2 and 4 are identical (equal confidence); row 3 is the most confident, row 0
    # (uniform) the least.
    base = random_logits(5, 100, device, dtype, seed=4)
    base[0] = 0.0
    base[1:3] = base[4]
    base[3] = base[4]
    base[3] *= 2.0  # sharper: the same argmax, more confident
    req = make_requests([5], 0, [rule], device, threshold=0.99, factor=0.5, k=3)
    got, want = run_both(base, 99, req, block_v=32, block_r=2)
    assert_same(got, want, dtype)
    if rule == "topk":
        assert got[2].tolist() == [False, True, True, True, False]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", CONFIGS[:2], ids=["default", "vsplit"])
def test_argmax_ties_and_the_mask_token(device, dtype, config):
    """Equal maxima: the lowest token wins, also across chunks and splits; the mask token, even
    with the largest logit, is never chosen."""
    logits = torch.zeros(4, 130)
    logits[0, [10, 40, 100]] = 4.0
    logits[1, [70, 33]] = 4.0
    logits[2, 5] = 9.0  # the mask token
    logits[2, [90, 120]] = 2.0
    logits[3, :] = 1.0
    logits = logits.to(device, dtype)
    req = make_requests([4], 0, ["threshold"], device)
    got, want = run_both(logits, 5, req, **config)
    assert_same(got, want, dtype)
    assert got[0].tolist() == [10, 33, 90, 0]


@pytest.mark.parametrize("device,dtype", FAST_CASES)
def test_many_requests_and_chunks(device, dtype):
    """More candidates than the rule tile, several requests with mixed rules and temperatures."""
    rows = [9, 40, 3, 17]
    logits = random_logits(sum(rows), 150, device, dtype, seed=5, spread=4.0)
    req = make_requests(rows, [0, 1, 3, 0], ["factor", "threshold", "topk", "topk"], device,
                        threshold=[0.5, 0.2, 0.9, 0.9], factor=[2.0, 1.0, 1.0, 1.0],
                        k=[1, 1, 4, 6], temperature=[0.0, 0.3, 1.0, 0.0])
    got, want = run_both(logits, 149, req, block_r=16, block_v=64)
    assert_same(got, want, dtype)


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=_GPU)])
def test_full_vocab_on_gpu(device, dtype):
    """Real vocabulary sizes with the default (split) configuration."""
    for m, v in [(32, 126464), (200, 152064)]:
        logits = random_logits(m, v, device, dtype, seed=m, spread=2.0)
        rows = [m // 2, m - m // 2]
        req = make_requests(rows, [1, 0], ["threshold", "factor"], device,
                            temperature=[0.0, 0.5])
        got, want = run_both(logits, v - 100, req)
        assert_same(got, want, dtype)
