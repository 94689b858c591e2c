"""Unmasking rules: which candidates of a step to commit (docs/design.md §2)."""

from __future__ import annotations

from collections.abc import Sequence

RULE_IDS = {"threshold": 0, "factor": 1, "topk": 2}


def rank_candidates(conf: Sequence[float]) -> list[int]:
    """Candidate indices by confidence, descending; ties go to the earlier position."""
    return sorted(range(len(conf)), key=lambda i: (-conf[i], i))


def select_commits(conf: Sequence[float], rule: str, threshold: float = 0.9, factor: float = 1.0,
                   tokens_per_step: int = 1) -> list[int]:
    """Indices (into ``conf``, candidates in position order) to commit this step.

    threshold: every c >= threshold, and always the most confident one.
    factor:    the longest confidence-sorted prefix where the k-th (k >= 2) has c >= 1 - f/(k+1).
    topk:      the ``tokens_per_step`` most confident.
    An empty candidate list commits nothing.
    """
    if not conf:
        return []
    order = rank_candidates(conf)
    if rule == "threshold":
        chosen = [i for i in order if conf[i] >= threshold]
        return sorted(chosen or order[:1])
    if rule == "factor":
        n = 1
        while n < len(order) and conf[order[n]] >= 1.0 - factor / (n + 2):
            n += 1
        return sorted(order[:n])
    if rule == "topk":
        return sorted(order[:tokens_per_step])
    raise ValueError(f"unknown unmasking rule {rule!r}")
