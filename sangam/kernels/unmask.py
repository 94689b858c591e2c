"""Fused confidence scoring (docs/design.md §2, §5.3): each logits row's token and confidence.

One pass over each row's logits in vocabulary chunks: an online softmax (running max and sum
of exponentials) together with the running argmax of the logits (temperature 0) or of
``logits / t + gumbel`` (temperature t > 0, noise from the same lowbias32 hash as
``sangam.decoding.noise``), so no ``[rows, vocab]`` float32 copy is ever made. When there are
too few rows to fill the GPU, each row's vocabulary is split across programs and a small kernel
merges the partial statistics.

The result equals ``sangam.decoding.score_logits``'s tokens and confidences (its reference).
Which rows commit is the host's to decide, by the decoding rules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sangam.kernels.platform import compiled, num_sms


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wrapping multiplies, logical shifts)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _confidence(x, m, s):
    """softmax probability exp(x - m - log s), evaluated in fp64 (GPU fp32 exp/log are
    approximate; this runs once per row)."""
    return tl.exp(x.to(tl.float64) - m.to(tl.float64) - tl.log(s.to(tl.float64)))


# Per batch (and per rank): no variant per split count or vocabulary offset.
@triton.jit(do_not_specialize=["num_splits", "vocab_offset"])
def _score_kernel(
    logits_ptr, temp_ptr, keys_ptr,
    tok_ptr, conf_ptr,  # final outputs (one split)
    pm_ptr, ps_ptr, pkey_ptr, pidx_ptr, px_ptr,  # per-split partials [M, S]
    vocab, s_row, mask_token_id, num_splits, vocab_offset,
    BLOCK_V: tl.constexpr, SPLIT: tl.constexpr, CDT: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temp_ptr + row).to(CDT)
    hot = t > 0
    key = tl.load(keys_ptr + row).to(tl.uint32)
    chunk = tl.cdiv(tl.cdiv(vocab, num_splits), BLOCK_V) * BLOCK_V
    v_lo = split * chunk
    v_hi = tl.minimum(vocab, v_lo + chunk)
    base = logits_ptr + row.to(tl.int64) * s_row

    m = tl.full([], float("-inf"), CDT)  # running max of the logits
    s = tl.zeros([], CDT)  # running sum of exp(logit - m)
    best = tl.full([], float("-inf"), CDT)  # running max of the argmax key
    best_idx = tl.zeros([], tl.int32)
    best_x = tl.full([], float("-inf"), CDT)  # the logit at best_idx
    for start in range(v_lo, v_hi, BLOCK_V):
        # Tiles start at multiples of BLOCK_V and only the vocabulary end masks the load, so
        # the compiler can use 16-byte vector loads (a per-element mask would make them
        # scalar); the mask token is excluded after the load.
        offs = tl.multiple_of(start, BLOCK_V) + tl.arange(0, BLOCK_V)
        x = tl.load(base + offs, mask=offs < v_hi, other=float("-inf")).to(CDT)
        ids = offs + vocab_offset  # token ids: a vocabulary shard's columns start there
        x = tl.where(ids == mask_token_id, float("-inf"), x)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new
        if hot:
            # Same arithmetic as the reference: noise in fp64, then cast; IEEE division (Triton's
            # fp32 `/` is approximate on GPU).
            h = _mix32(key ^ ids.to(tl.uint32))
            u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
            g = (-tl.log(-tl.log(u))).to(CDT)
            if CDT == tl.float64:
                k = x / t + g
            else:
                k = tl.math.div_rn(x, tl.zeros_like(x) + t) + g
        else:
            k = x
        k_max = tl.max(k, 0)
        k_idx = tl.min(tl.where(k == k_max, ids, 2147483647), 0)
        if k_max > best:  # strict: ties keep the earlier (lower) index
            best = k_max
            best_idx = k_idx
            best_x = tl.max(tl.where(ids == k_idx, x, float("-inf")), 0)
    if SPLIT:
        p = row.to(tl.int64) * num_splits + split
        tl.store(pm_ptr + p, m)
        tl.store(ps_ptr + p, s)
        tl.store(pkey_ptr + p, best)
        tl.store(pidx_ptr + p, best_idx)
        tl.store(px_ptr + p, best_x)
    else:
        tl.store(tok_ptr + row, best_idx.to(tl.int64))
        tl.store(conf_ptr + row, _confidence(best_x, m, s).to(CDT))


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    pm_ptr, ps_ptr, pkey_ptr, pidx_ptr, px_ptr, tok_ptr, conf_ptr, num_splits,
    BLOCK_S: tl.constexpr, CDT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    ok = sp < num_splits
    p = row * num_splits + sp
    pm = tl.load(pm_ptr + p, mask=ok, other=float("-inf"))
    ps = tl.load(ps_ptr + p, mask=ok, other=0.0)
    pkey = tl.load(pkey_ptr + p, mask=ok, other=float("-inf"))
    m = tl.max(pm, 0)
    s = tl.sum(ps * tl.exp(pm - tl.where(m == float("-inf"), 0.0, m)), 0)
    # Splits cover increasing vocabulary ranges: the first split holding the best key wins.
    first = tl.min(tl.where(pkey == tl.max(pkey, 0), sp, BLOCK_S), 0)
    first = tl.minimum(first, num_splits - 1)  # NaN keys match nothing: stay in bounds
    idx = tl.load(pidx_ptr + row * num_splits + first)
    x = tl.load(px_ptr + row * num_splits + first)
    tl.store(tok_ptr + row, idx.to(tl.int64))
    tl.store(conf_ptr + row, _confidence(x, m, s).to(CDT))


def fused_score(logits: torch.Tensor, mask_token_id: int, temperature: torch.Tensor,
                row_keys: torch.Tensor, *, block_v: int | None = None,
                num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``logits [M, V]``: its token (never ``mask_token_id``) and confidence, as
    ``sangam.decoding.score_logits`` with ``temperature`` float ``[M]`` (read in its own float
    dtype: pass float64 for bit-exact agreement with Python-float parameters) and ``row_keys``
    int64 ``[M]`` (uint32 noise keys). ``block_v`` (vocabulary tile) and ``num_splits``
    (vocabulary splits per row) override the defaults. Returns (tokens int64 ``[M]``,
    confidence ``[M]`` fp32 — fp64 for fp64 logits)."""
    m_rows, vocab = logits.shape
    dev = logits.device
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = torch.empty(m_rows, dtype=torch.int64, device=dev)
    conf = torch.empty(m_rows, dtype=cdt, device=dev)
    if m_rows == 0:
        return tokens, conf
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    on_gpu = compiled(dev)
    tl_cdt = tl.float64 if cdt == torch.float64 else tl.float32

    block_v = _block_v(block_v, vocab, on_gpu)
    if num_splits is None:
        num_splits = score_splits(m_rows, vocab, dev)
    split = num_splits > 1
    if split:
        pm, ps, pkey, px = (torch.empty(m_rows, num_splits, dtype=cdt, device=dev)
                            for _ in range(4))
        pidx = torch.empty(m_rows, num_splits, dtype=torch.int32, device=dev)
    else:
        pm = ps = pkey = px = pidx = conf  # unused
    _score_kernel[(m_rows, num_splits)](
        logits, temperature, row_keys.contiguous(), tokens, conf,
        pm, ps, pkey, pidx, px,
        vocab, logits.stride(0), mask_token_id, num_splits, 0,
        BLOCK_V=block_v, SPLIT=split, CDT=tl_cdt,
        num_warps=8 if on_gpu else 1,
    )
    if split:
        _merge_kernel[(m_rows,)](
            pm, ps, pkey, pidx, px, tokens, conf, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), CDT=tl_cdt, num_warps=1)
    return tokens, conf



def _block_v(block_v: int | None, vocab: int, on_gpu: bool) -> int:
    """The vocabulary tile: 4096 on GPU, 256 in the interpreter, within the vocabulary."""
    return min(block_v or (4096 if on_gpu else 256), triton.next_power_of_2(vocab))


def score_splits(m_rows: int, vocab: int, device: torch.device) -> int:
    """Vocabulary splits per row: enough programs to fill the GPU when rows are few, each
    split at least four tiles; one off the GPU."""
    if not compiled(device):
        return 1
    block_v = _block_v(None, vocab, True)
    return max(1, min(triton.cdiv(4 * num_sms(device), m_rows), vocab // (4 * block_v)))


def fused_shard_scores(logits: torch.Tensor, vocab_start: int, mask_token_id: int,
                       temperature: torch.Tensor, row_keys: torch.Tensor,
                       num_splits: int) -> torch.Tensor:
    """``sangam.decoding.confidence.shard_scores`` of a vocabulary shard ``logits [M, Vs]``
    (tokens ``vocab_start ..``) in one pass, per split of its columns: ``[num_splits, 5, M]``
    fp64 (``SHARD_FIELDS`` order), the splits in vocabulary order, ready for
    ``combine_shard_scores`` with every other rank's. No ``[M, Vs]`` copy is made."""
    m_rows, vocab = logits.shape
    dev = logits.device
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    pm, ps, pkey, px = (torch.empty(m_rows, num_splits, dtype=cdt, device=dev)
                        for _ in range(4))
    pidx = torch.empty(m_rows, num_splits, dtype=torch.int32, device=dev)
    if m_rows:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        on_gpu = compiled(dev)
        _score_kernel[(m_rows, num_splits)](
            logits, temperature, row_keys.contiguous(), pm, pm,  # no final outputs
            pm, ps, pkey, pidx, px,
            vocab, logits.stride(0), mask_token_id, num_splits, vocab_start,
            BLOCK_V=_block_v(None, vocab, on_gpu), SPLIT=True,
            CDT=tl.float64 if cdt == torch.float64 else tl.float32,
            num_warps=8 if on_gpu else 1,
        )
    return torch.stack([pm, ps, pkey, px, pidx.to(cdt)]).permute(2, 0, 1).to(torch.float64)
