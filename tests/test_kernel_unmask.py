"""Fused confidence scoring kernel vs score_logits (its reference)."""

from __future__ import annotations

import os

import pytest
import torch

from sangam.decoding import score_logits
from sangam.kernels.unmask import fused_score

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
# Kernel configs: default; vocab split across programs; small vocab tiles.
CONFIGS = [{}, {"num_splits": 3, "block_v": 32}, {"block_v": 64}]


def row_temperatures(temperature, rows, device):
    """Per-row float64 temperatures (bit-exact with Python floats); a scalar for every row."""
    vals = temperature if isinstance(temperature, list) else [temperature] * rows
    return torch.tensor(vals, dtype=torch.float64, device=device)


def run_both(logits, mask_id, temperature=0.0, row_keys=None, **kw):
    if row_keys is None:
        g = torch.Generator().manual_seed(1)
        row_keys = torch.randint(0, 2**32, (logits.shape[0],), generator=g)
    row_keys = row_keys.to(logits.device)
    temps = row_temperatures(temperature, logits.shape[0], logits.device)
    got = fused_score(logits, mask_id, temps, row_keys, **kw)
    want = score_logits(logits, mask_id, temps, row_keys)
    return got, (want.tokens, want.conf)


def assert_same(got, want, logits_dtype):
    tokens, conf = got
    rtokens, rconf = want
    cdt = torch.float64 if logits_dtype == torch.float64 else torch.float32
    assert tokens.dtype == torch.int64 and conf.dtype == cdt
    assert torch.equal(tokens, rtokens)
    # GPU fp32 exp is approximate (~2 ulp per term of the softmax sum).
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 1e-5}[logits_dtype]
    torch.testing.assert_close(conf, rconf.to(cdt), atol=tol, rtol=tol)


def random_logits(m, v, device, dtype, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (spread * torch.randn(m, v, generator=g)).to(device, dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "vsplit", "small-tiles"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_scores_match_the_reference(device, dtype, config, temperature):
    # Vocab 300 is not a multiple of any chunk.
    logits = random_logits(19, 300, device, dtype)
    got, want = run_both(logits, 299, temperature, **config)
    assert_same(got, want, dtype)
    assert (got[0] != 299).all()


@pytest.mark.parametrize("device,dtype", CASES)
def test_no_rows(device, dtype):
    got, want = run_both(torch.zeros(0, 300, device=device, dtype=dtype), 299)
    assert_same(got, want, dtype)
    assert got[0].shape == got[1].shape == (0,)


@pytest.mark.parametrize("device,dtype", CASES)
def test_sampling_uses_the_hash_noise(device, dtype):
    """With temperature > 0 the kernel draws the reference's Gumbel noise, token for token."""
    logits = random_logits(24, 200, device, dtype, seed=3, spread=1.0)
    got, want = run_both(logits, 7, 1.5, block_v=64)
    assert_same(got, want, dtype)
    assert not torch.equal(got[0], logits.float().argmax(1))  # the noise changed some tokens
    assert (got[0] != 7).all()


@pytest.mark.parametrize("device,dtype", CASES)
def test_equal_rows_score_equally(device, dtype):
    # Rows 1, 2 and 4 are identical; row 3 has the same argmax, more confident; row 0 is
    # uniform.
    base = random_logits(5, 100, device, dtype, seed=4)
    base[0] = 0.0
    base[1:3] = base[4]
    base[3] = base[4]
    base[3] *= 2.0  # sharper: the same argmax, more confident
    got, want = run_both(base, 99, block_v=32)
    assert_same(got, want, dtype)
    tokens, conf = got[0].tolist(), got[1].tolist()
    assert tokens[1] == tokens[2] == tokens[3] == tokens[4] and tokens[0] == 0
    assert conf[1] == conf[2] == conf[4] < conf[3] and conf[0] < conf[1]


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
    got, want = run_both(logits, 5, **config)
    assert_same(got, want, dtype)
    assert got[0].tolist() == [10, 33, 90, 0]


@pytest.mark.parametrize("device,dtype", FAST_CASES)
def test_many_rows_and_mixed_temperatures(device, dtype):
    """More rows than a program's tile, greedy and sampled rows mixed."""
    logits = random_logits(69, 150, device, dtype, seed=5, spread=4.0)
    temps = [0.0, 0.3, 1.0, 0.0] * 17 + [0.5]
    got, want = run_both(logits, 149, temps, block_v=64)
    assert_same(got, want, dtype)


@pytest.mark.parametrize("device,dtype", [pytest.param("cuda", torch.bfloat16, marks=_GPU)])
def test_full_vocab_on_gpu(device, dtype):
    """Real vocabulary sizes with the default (split) configuration."""
    for m, v in [(32, 126464), (200, 152064)]:
        logits = random_logits(m, v, device, dtype, seed=m, spread=2.0)
        temps = [0.0] * (m // 2) + [0.5] * (m - m // 2)
        got, want = run_both(logits, v - 100, temps)
        assert_same(got, want, dtype)
