"""What tests/test_rollout.py and tests/test_rollout_gpu.py share: requests, and a trainer's
update of a checkpoint. Imports only what the GPU machine has."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sangam import SamplingParams
from sangam.models import load_model
from sangam.models.loader import save_checkpoint

PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], list(range(20, 37)), [11]]
PARAMS = [SamplingParams(max_tokens=12, block_length=4, seed=1),
          SamplingParams(max_tokens=8, block_length=4, cache="prefix", temperature=0.8, seed=2),
          SamplingParams(max_tokens=12, block_length=4, cache="none", unmasking="topk",
                         tokens_per_step=2, seed=3),
          SamplingParams(max_tokens=8, block_length=8, temperature=1.0, top_k=20, seed=4)]


def perturbed(src: str, dst: Path, seed: int) -> str:
    """A copy of the checkpoint at ``src`` with every weight moved: what a trainer's step
    makes of it."""
    model = load_model(src, "cpu", "float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std().nan_to_num(0.1) * torch.randn(p.shape, generator=gen))
    save_checkpoint(model, json.loads((Path(src) / "config.json").read_text()), dst)
    return str(dst)


def state(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, as a trainer holds them (float32)."""
    return dict(load_model(path, "cpu", "float32").state_dict())
