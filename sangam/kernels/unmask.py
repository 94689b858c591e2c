"""Fused confidence unmasking (DESIGN.md §2, §5.3).

Phase 1, one pass over each row's logits in vocabulary chunks: an online softmax (running max
and sum of exponentials) together with the running argmax of the logits (temperature 0) or of
``logits / t + gumbel`` (temperature t > 0, noise from the same lowbias32 hash as
``sangam.decoding.noise``), so no ``[rows, vocab]`` float32 copy is ever made. When there are
too few rows to fill the GPU, each row's vocabulary is split across programs and a small kernel
merges the partial statistics.

Phase 2, one program per request: the first ``num_forced[r]`` rows are committed; among the
rest, each candidate's rank by (confidence desc, row asc) comes from pairwise comparisons, and
the request's rule (threshold / factor / topk) decides from the ranks.

The result equals ``sangam.decoding.score_logits`` + ``select_commits`` (see
``sangam.decoding.unmask_reference.unmask_ref``).
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


@triton.jit
def _score_kernel(
    logits_ptr, temp_ptr, keys_ptr,
    tok_ptr, conf_ptr,  # final outputs (one split)
    pm_ptr, ps_ptr, pkey_ptr, pidx_ptr, px_ptr,  # per-split partials [M, S]
    vocab, s_row, mask_token_id, num_splits,
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
        x = tl.where(offs == mask_token_id, float("-inf"), x)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no inf - inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new
        if hot:
            # Same arithmetic as the reference: noise in fp64, then cast; IEEE division (Triton's
            # fp32 `/` is approximate on GPU).
            h = _mix32(key ^ offs.to(tl.uint32))
            u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
            g = (-tl.log(-tl.log(u))).to(CDT)
            if CDT == tl.float64:
                k = x / t + g
            else:
                k = tl.math.div_rn(x, tl.zeros_like(x) + t) + g
        else:
            k = x
        k_max = tl.max(k, 0)
        k_idx = tl.min(tl.where(k == k_max, offs, 2147483647), 0)
        if k_max > best:  # strict: ties keep the earlier (lower) index
            best = k_max
            best_idx = k_idx
            best_x = tl.max(tl.where(offs == k_idx, x, float("-inf")), 0)
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


@triton.jit
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


@triton.jit
def _ranks(conf_ptr, i, ci, c0, b, BLOCK_R: tl.constexpr):
    """Rank of candidates i (confidences ci) among candidates c0..b-1: how many come first by
    (confidence desc, row asc)."""
    rank = tl.zeros([BLOCK_R], tl.int32)
    for js in range(c0, b, BLOCK_R):
        j = js + tl.arange(0, BLOCK_R)
        cj = tl.load(conf_ptr + j, mask=j < b, other=0.0).to(tl.float64)
        first = (cj[None, :] > ci[:, None]) | (
            (cj[None, :] == ci[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((first & (j < b)[None, :]).to(tl.int32), 1)
    return rank


@triton.jit
def _rule_kernel(
    conf_ptr, commit_ptr, cu_ptr, forced_ptr, rule_ptr, thr_ptr, factor_ptr, k_ptr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0)
    a = tl.load(cu_ptr + r)
    b = tl.load(cu_ptr + r + 1)
    c0 = a + tl.minimum(tl.maximum(tl.load(forced_ptr + r), 0), b - a)
    rule = tl.load(rule_ptr + r)
    thr = tl.load(thr_ptr + r).to(tl.float64)
    fac = tl.load(factor_ptr + r).to(tl.float64)
    topk = tl.load(k_ptr + r)
    lanes = tl.arange(0, BLOCK_R)

    for start in range(a, c0, BLOCK_R):
        i = start + lanes
        tl.store(commit_ptr + i, tl.full([BLOCK_R], 1, tl.int1), mask=i < c0)

    # factor: the committed prefix ends at the first rank k >= 1 whose confidence is below
    # 1 - f / (k + 2) (0-based k); ranks come from pairwise comparisons.
    n_factor = b - c0
    if rule == 1:
        for start in range(c0, b, BLOCK_R):
            i = start + lanes
            ci = tl.load(conf_ptr + i, mask=i < b, other=0.0).to(tl.float64)
            rank = _ranks(conf_ptr, i, ci, c0, b, BLOCK_R)
            fails = (i < b) & (rank >= 1) & (ci < 1.0 - fac / (rank + 2).to(tl.float64))
            n_factor = tl.minimum(n_factor, tl.min(tl.where(fails, rank, b - c0), 0))

    for start in range(c0, b, BLOCK_R):
        i = start + lanes
        ci = tl.load(conf_ptr + i, mask=i < b, other=0.0).to(tl.float64)
        rank = _ranks(conf_ptr, i, ci, c0, b, BLOCK_R)
        commit = tl.where(rule == 0, (ci >= thr) | (rank == 0),
                          tl.where(rule == 1, rank < n_factor, rank < topk))
        tl.store(commit_ptr + i, commit, mask=i < b)


def fused_score(logits: torch.Tensor, mask_token_id: int, temperature: torch.Tensor,
                row_keys: torch.Tensor, *, block_v: int | None = None,
                num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of :func:`fused_unmask` alone: each row's token and confidence, with
    ``temperature`` per row (float ``[M]``, as ``sangam.decoding.score_logits``; other
    arguments as there). The engine uses it alone, since its host commits by the rules itself
    (after any rows are scored again). Returns (tokens int64 ``[M]``, confidence ``[M]`` fp32
    — fp64 for fp64 logits)."""
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

    if block_v is None:
        block_v = 4096 if on_gpu else 256
    block_v = min(block_v, triton.next_power_of_2(vocab))
    if num_splits is None:
        num_splits = 1
        if on_gpu:
            num_splits = max(1, min(triton.cdiv(4 * num_sms(dev), m_rows), vocab // (4 * block_v)))
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
        vocab, logits.stride(0), mask_token_id, num_splits,
        BLOCK_V=block_v, SPLIT=split, CDT=tl_cdt,
        num_warps=8 if on_gpu else 1,
    )
    if split:
        _merge_kernel[(m_rows,)](
            pm, ps, pkey, pidx, px, tokens, conf, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), CDT=tl_cdt, num_warps=1)
    return tokens, conf


def fused_unmask(logits: torch.Tensor, mask_token_id: int, cu_rows: torch.Tensor,
                 num_forced: torch.Tensor, rule: torch.Tensor, threshold: torch.Tensor,
                 factor: torch.Tensor, tokens_per_step: torch.Tensor, temperature: torch.Tensor,
                 row_keys: torch.Tensor, *, block_v: int | None = None,
                 num_splits: int | None = None, block_r: int | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score every row of ``logits [M, V]`` and apply each request's unmasking rule.

    Rows ``cu_rows[r]:cu_rows[r+1]`` (int32 ``[R+1]``) belong to request r; its first
    ``num_forced[r]`` rows are committed regardless, the rest are rule candidates in position
    order. ``rule`` int32 ``[R]`` (``sangam.decoding.RULE_IDS``), ``threshold``/``factor``
    float ``[R]``, ``tokens_per_step`` int32 ``[R]``, ``temperature`` float ``[R]``,
    ``row_keys`` int64 ``[M]`` (uint32 noise keys). Threshold, factor and temperature are read
    in whatever float dtype they come in: pass float64 for bit-exact agreement with Python-float
    parameters. ``block_v``, ``num_splits`` (vocabulary splits per row) and ``block_r`` (rule
    tile) override the defaults.

    Returns (tokens int64 ``[M]``, confidence ``[M]`` fp32 — fp64 for fp64 logits —, commit
    bool ``[M]``).
    """
    m_rows = logits.shape[0]
    num_requests = cu_rows.numel() - 1
    cu = cu_rows.to(torch.int32)
    # Each row's temperature is its request's (output_size: no host sync on GPU).
    row_temperature = torch.repeat_interleave(temperature, cu[1:] - cu[:-1], output_size=m_rows)
    tokens, conf = fused_score(logits, mask_token_id, row_temperature, row_keys,
                               block_v=block_v, num_splits=num_splits)
    commit = torch.zeros(m_rows, dtype=torch.bool, device=logits.device)
    if m_rows == 0 or num_requests == 0:
        return tokens, conf, commit
    on_gpu = compiled(logits.device)
    _rule_kernel[(num_requests,)](
        conf, commit, cu, num_forced, rule, threshold, factor, tokens_per_step,
        BLOCK_R=block_r or (64 if on_gpu else 32), num_warps=4 if on_gpu else 1,
    )
    return tokens, conf, commit
