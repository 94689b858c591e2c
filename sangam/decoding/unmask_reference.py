"""The fused unmasking kernel's reference (``sangam.kernels.unmask``): the decoding layer's own
scoring (``score_logits``) and rules (``select_commits``), composed as the kernel composes them.
It lives here, not beside the kernel, because it is made of decoding's parts and the layers
depend downwards only (the kernels on nothing of Sangam's).
"""

from __future__ import annotations

import torch

from sangam.decoding.confidence import score_logits
from sangam.decoding.rules import RULE_IDS, select_commits


def unmask_ref(logits: torch.Tensor, mask_token_id: int, cu_rows: torch.Tensor,
               num_forced: torch.Tensor, rule: torch.Tensor, threshold: torch.Tensor,
               factor: torch.Tensor, tokens_per_step: torch.Tensor, temperature: torch.Tensor,
               row_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Score every row (:func:`sangam.decoding.score_logits`), then per request commit the first
    ``num_forced[r]`` rows and the rows :func:`sangam.decoding.select_commits` picks among the
    rest. Returns (tokens int64 [M], confidence [M], commit bool [M])."""
    rule_names = {v: k for k, v in RULE_IDS.items()}
    cu = cu_rows.tolist()
    counts = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    temp_rows = torch.repeat_interleave(temperature.to(torch.float64).cpu(),
                                        torch.tensor(counts, dtype=torch.int64))
    tokens, conf, _ = score_logits(logits, mask_token_id, temp_rows.to(logits.device), row_keys)
    commit = torch.zeros(logits.shape[0], dtype=torch.bool)
    conf_host = conf.double().cpu().tolist()
    for r, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        forced = min(int(num_forced[r]), b - a)
        commit[a:a + forced] = True
        chosen = select_commits(conf_host[a + forced:b], rule_names[int(rule[r])],
                                threshold=float(threshold[r]), factor=float(factor[r]),
                                tokens_per_step=int(tokens_per_step[r]))
        for i in chosen:
            commit[a + forced + i] = True
    return tokens, conf, commit.to(logits.device)
