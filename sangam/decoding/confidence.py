"""From LM-head logits to (token, confidence) per candidate row (docs/design.md §2)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sangam.decoding.logit_edits import LogitEdits, apply_edits
from sangam.decoding.noise import gumbel_noise


class Scores(NamedTuple):
    tokens: torch.Tensor  # int64 [M]
    conf: torch.Tensor  # [M], fp32 (fp64 for fp64 logits)
    # With top_n > 0: each row's top_n most probable tokens, most probable first, as
    # (log-probabilities [M, top_n], token ids [M, top_n]); else None.
    top: tuple[torch.Tensor, torch.Tensor] | None


def score_logits(logits: torch.Tensor, mask_token_id: int, temperature: torch.Tensor | None = None,
                 row_keys: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                 top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
                 edits: LogitEdits | None = None, top_n: int = 0,
                 hot: torch.Tensor | None = None) -> Scores:
    """Token and confidence for each row of ``logits [M, V]``, after ``edits`` (logit_bias,
    penalties, min_tokens: see ``logit_edits.py``; tensors on any device) of the logits.

    Temperature 0: token = argmax (first index on ties), confidence = its softmax probability.
    Temperature t > 0: token = argmax(logits / t + Gumbel noise from ``row_keys``) over the
    tokens :func:`sampling_support` keeps (``top_p`` float ``[M]``, 1 = all; ``top_k`` int
    ``[M]``, 0 = all; ``min_p`` float ``[M]``, 0 = all), confidence = the *untempered*
    probability of that token. The mask token is never chosen. Math runs in fp32, or fp64 for
    fp64 logits. ``top_n`` > 0 also ranks each row's most probable tokens under the same
    (edited, untempered) distribution, whose log-probability the confidence is: the
    alternatives of OpenAI's ``top_logprobs``. ``hot``: the indices of the rows with
    temperature > 0, when the caller knows them on the host (finding them on the device costs
    two syncs).
    """
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt, copy=True)
    if edits is not None:
        apply_edits(x, edits.map(lambda a: a.to(x.device)))
    x[:, mask_token_id] = float("-inf")
    logp = torch.log_softmax(x, dim=-1)
    tokens = x.argmax(dim=-1)
    if hot is None and temperature is not None and bool((temperature > 0).any()):
        hot = (temperature.to(x.device) > 0).nonzero().flatten()
    if hot is not None and hot.numel():  # the shape: known without a sync
        temperature = temperature.to(x.device)
        scaled = x[hot] / temperature[hot].to(cdt)[:, None]
        noisy = scaled + gumbel_noise(row_keys.to(x.device)[hot], x.shape[1], cdt)
        if top_p is not None or top_k is not None or min_p is not None:
            def per_row(v: torch.Tensor | None, neutral: float) -> torch.Tensor:
                return (v if v is not None else torch.full((len(x),), neutral)).to(x.device)[hot]

            keep = sampling_support(scaled, per_row(top_p, 1.0), per_row(top_k, 0),
                                    per_row(min_p, 0.0))
            noisy.masked_fill_(~keep, float("-inf"))  # a boolean index would sync
        tokens[hot] = noisy.argmax(dim=-1)
    conf = logp.gather(1, tokens[:, None]).squeeze(1).exp()
    top = None
    if top_n > 0:  # sorted, and stable so that ties list the lower token id first
        order = torch.sort(logp, dim=-1, descending=True, stable=True)
        top = order.values[:, :top_n], order.indices[:, :top_n]
    return Scores(tokens, conf, top)


def sampling_support(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """Which tokens each row of tempered logits ``scaled [H, V]`` may sample (bool ``[H, V]``),
    as in vLLM: rank tokens by probability (ties: lower id first); keep those with at least
    ``min_p[i]`` times the top token's probability (0: all), and the ``top_k[i]`` first (0: all);
    of those, renormalized, keep the shortest prefix whose probability reaches ``top_p[i]``
    (1: all). The most probable token is always kept."""
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    probs = torch.softmax(scaled, dim=-1).gather(1, order)
    rank = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    keep = (rank < top_k[:, None]) | (top_k[:, None] <= 0)
    keep &= probs >= min_p.to(probs.dtype)[:, None] * probs[:, :1]
    kept = probs * keep  # every condition so far keeps a prefix of the ranking
    before = kept.cumsum(dim=-1) - kept  # kept probability ranked above each token
    keep &= (before < top_p.to(probs.dtype)[:, None] * kept.sum(dim=-1, keepdim=True)) | (
        top_p[:, None] >= 1)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, order, keep)


# Vocabulary-parallel scoring (tensor parallelism): each rank holds the logits of its slice of
# the vocabulary. Each reduces its slice to five numbers a row (``shard_scores``); the ranks
# exchange those (an all-gather of [5, M], not of the logits) and each combines them
# (``combine_shard_scores``) into score_logits' tokens and confidences.
SHARD_FIELDS = ("max", "sum", "key", "logit", "token")


def shard_scores(logits: torch.Tensor, vocab_start: int, mask_token_id: int,
                 temperature: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
    """``[5, M]`` in fp64 (exact for every field, token ids included), per row of this shard
    ``logits [M, Vs]`` (tokens ``vocab_start ..``): the max logit, the sum of exp(logit - max),
    and the shard's best token under score_logits' first pass (argmax of the logits, or of
    logits / t + Gumbel noise for temperature t > 0, first index on ties) with its key and
    logit. The mask token is never chosen. Math in fp32, or fp64 for fp64 logits."""
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt, copy=True)
    width = x.shape[1]
    if vocab_start <= mask_token_id < vocab_start + width:
        x[:, mask_token_id - vocab_start] = float("-inf")
    top = x.max(dim=-1).values
    finite = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # a mask-only shard
    total = torch.exp(x - finite[:, None]).sum(dim=-1)
    key = x
    hot = (temperature > 0).nonzero().flatten()  # sampled rows: noise for them alone
    if hot.numel():
        t = temperature.to(device=x.device, dtype=cdt)[hot]
        key = x.clone()
        key[hot] = x[hot] / t[:, None] + gumbel_noise(row_keys.to(x.device)[hot], width, cdt,
                                                      start=vocab_start)
    best = key.argmax(dim=-1)
    return torch.stack([top, total, key.gather(1, best[:, None]).squeeze(1),
                        x.gather(1, best[:, None]).squeeze(1), best + vocab_start]
                       ).to(torch.float64)


def combine_shard_scores(shards: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """score_logits' (tokens, conf) from every rank's :func:`shard_scores`, stacked
    ``[ranks, 5, M]`` in vocabulary order: the best key wins (the lower token on ties, as
    the ranks are in vocabulary order), and its probability is taken over every shard's sum.
    ``conf`` in ``dtype`` (score_logits': fp32, or fp64 for fp64 logits)."""
    top, total, key, logit, token = shards.unbind(1)  # each [ranks, M]
    winner = key.argmax(dim=0, keepdim=True)
    peak = top.max(dim=0).values
    finite = torch.where(torch.isinf(top), torch.full_like(top, float("-inf")), top)
    norm = (total * torch.exp(finite - peak)).sum(dim=0)
    chosen = logit.gather(0, winner).squeeze(0)
    conf = torch.exp(chosen - peak) / norm
    return token.gather(0, winner).squeeze(0).to(torch.int64), conf.to(dtype)
