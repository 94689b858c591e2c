"""What the demo models' training scripts (``scripts/train_demo_model.py``,
``scripts/train_demo_gemma.py``) share: the optimizer and its learning-rate schedule."""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Schedule(Protocol):
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float
    weight_decay: float


def make_optimizer(model: torch.nn.Module, cfg: Schedule) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95), weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, cfg: Schedule) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5
                     * (1 + math.cos(math.pi * progress)))
