"""From LM-head logits to (token, confidence) per candidate row (DESIGN.md §2)."""

from __future__ import annotations

import torch

from sangam.decoding.noise import gumbel_noise


def score_logits(logits: torch.Tensor, mask_token_id: int, temperature: torch.Tensor | None = None,
                 row_keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and confidence for each row of ``logits [M, V]``.

    Temperature 0: token = argmax (first index on ties), confidence = its softmax probability.
    Temperature t > 0: token = argmax(logits / t + Gumbel noise from ``row_keys``), confidence =
    the *untempered* probability of that token. The mask token is never chosen. Math runs in
    fp32, or fp64 for fp64 logits. Returns (int64 tokens, confidences in that dtype).
    """
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(cdt, copy=True)
    x[:, mask_token_id] = float("-inf")
    logp = torch.log_softmax(x, dim=-1)
    tokens = x.argmax(dim=-1)
    if temperature is not None and bool((temperature > 0).any()):
        temperature = temperature.to(x.device)
        hot = (temperature > 0).nonzero().flatten()
        t = temperature[hot].to(cdt)[:, None]
        noisy = x[hot] / t + gumbel_noise(row_keys.to(x.device)[hot], x.shape[1], cdt)
        tokens[hot] = noisy.argmax(dim=-1)
    conf = logp.gather(1, tokens[:, None]).squeeze(1).exp()
    return tokens, conf
