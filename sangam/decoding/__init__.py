"""Decoding semantics of docs/design.md §2: unmasking rules, sampling, per-request progress."""

from sangam.decoding.confidence import score_logits
from sangam.decoding.noise import gumbel_noise, noise_key, row_key
from sangam.decoding.rules import RULE_IDS, rank_candidates, select_commits
from sangam.decoding.state import DecodeState, StepPlan

__all__ = [
    "RULE_IDS", "DecodeState", "StepPlan", "gumbel_noise", "noise_key",
    "rank_candidates", "row_key", "score_logits", "select_commits",
]
