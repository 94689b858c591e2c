"""A forward's first scoring pass (docs/design.md §2.5, §5.3, §4.10): each logits row's token and
confidence, by one of three scorers, chosen once, when the worker is built (``make_scorer``):

- ``ReferenceScorer``: decoding's ``score_logits``, the PyTorch reference;
- ``FusedScorer``: the fused Triton kernel (``fused_score``): one online-softmax pass a row,
  no ``[rows, vocab]`` fp32 copy;
- ``ShardScorer``: vocabulary-parallel, for a tensor-parallel group: each rank reduces its
  columns of a row to five numbers (the fused kernel's per-split partials, or the
  reference's), the ranks all-gather those and each combines them.

Each also gives rows of the whole-vocabulary logits by index (``rows``: gathered across a
group's ranks), for the rows scored again and the requests whose family reads its logits. The
kernel or reference is the worker's row of the kernel table (``models/kernel_table.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sangam.decoding.confidence import combine_shard_scores, score_logits, shard_scores
from sangam.engine.host_batch import PackedBatch
from sangam.engine.tensor_group import TensorGroup
from sangam.kernels.unmask import score_splits
from sangam.models.kernel_table import KernelTable

Rows = Callable[[torch.Tensor], torch.Tensor]  # row indices -> those rows, whole vocabulary


class ReferenceScorer:
    """``score_logits`` over the host's per-row inputs."""

    uploads_inputs = False  # the per-row inputs (temperatures, row keys) stay on the host

    def __init__(self, mask_token_id: int):
        self.mask_token_id = mask_token_id

    def score(self, logits: torch.Tensor, batch: PackedBatch, dev: dict[str, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, conf, _ = score_logits(logits, self.mask_token_id,
                                       torch.from_numpy(batch.temperatures),
                                       torch.from_numpy(batch.row_keys))
        return tokens, conf

    def rows(self, logits: torch.Tensor) -> Rows:
        return logits.__getitem__


class FusedScorer(ReferenceScorer):
    """The fused kernel, on the uploaded per-row inputs."""

    uploads_inputs = True

    def __init__(self, mask_token_id: int, fused_score: Callable):
        super().__init__(mask_token_id)
        self._fused_score = fused_score

    def score(self, logits: torch.Tensor, batch: PackedBatch, dev: dict[str, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused_score(logits, self.mask_token_id, dev["temperatures"],
                                 dev["row_keys"])


class ShardScorer:
    """Vocabulary-parallel scoring over this rank's columns: every rank of ``group`` scores the
    same rows and combines the same numbers, so every rank has every row's token and
    confidence; five numbers a row cross the group, never the logits."""

    uploads_inputs = True

    def __init__(self, mask_token_id: int, vocab_size: int, group: TensorGroup,
                 fused_shard_scores: Callable | None):
        self.mask_token_id = mask_token_id
        self.vocab_size = vocab_size
        self.group = group
        self._fused = fused_shard_scores

    def score(self, logits: torch.Tensor, batch: PackedBatch, dev: dict[str, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        g, mask = self.group, self.mask_token_id
        lo, _ = g.layout.vocab(self.vocab_size)
        temperature, keys = dev["temperatures"], dev["row_keys"]
        if self._fused is not None:  # the fused kernel, a few splits of the shard's columns
            # The same split count on every rank (the last shard may be narrower).
            splits = score_splits(len(logits), -(-self.vocab_size // g.size), logits.device)
            mine = self._fused(logits, lo, mask, temperature, keys, splits)
        else:
            mine = shard_scores(logits, lo, mask, temperature, keys)[None]
        cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return combine_shard_scores(g.all_gather_model(mine), cdt)

    def rows(self, logits: torch.Tensor) -> Rows:
        return lambda index: self.group.gather_vocab(logits[index], self.vocab_size)


Scorer = ReferenceScorer | FusedScorer | ShardScorer


def make_scorer(kernels: KernelTable, group: TensorGroup | None, mask_token_id: int,
                vocab_size: int) -> Scorer:
    """The worker's scorer: vocabulary-parallel under a group, else the fused kernel where
    the worker's kernels have it, else the reference."""
    if group is not None:
        return ShardScorer(mask_token_id, vocab_size, group, kernels.fused_shard_scores)
    if kernels.fused_score is not None:
        return FusedScorer(mask_token_id, kernels.fused_score)
    return ReferenceScorer(mask_token_id)
