"""The tokens each forward of a simulated block commits, where a real model's confidences would
decide: fixed, geometric, or the histogram a ``sangam-bench serve`` run recorded."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass


class StepModel:
    """How many positions each forward of a block commits (a refresh is the first step)."""

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class GeometricSteps(StepModel):
    """Each step commits k >= 1 tokens, k geometric with mean ``mean`` (the default 3.25 is
    Fast-dLLM's threshold 0.9 on LLaDA), the last step of a block what is left."""

    mean: float = 3.25

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"mean tokens per step must be >= 1, got {self.mean}")

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        out = []
        left = block_length
        p = 1.0 / self.mean
        log_q = math.log1p(-p) if p < 1 else -math.inf
        while left > 0:
            # Inverse CDF of the geometric distribution on {1, 2, ...}.
            k = 1 if p >= 1 else 1 + int(math.log(1.0 - rng.random()) / log_q)
            out.append(min(k, left))
            left -= out[-1]
        return out

    def describe(self) -> str:
        return f"geometric, mean {self.mean} tokens/step"


@dataclass(frozen=True)
class FixedSteps(StepModel):
    """Exactly ``tokens`` per step (the last step of a block: the rest)."""

    tokens: int

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        full, rest = divmod(block_length, self.tokens)
        return [self.tokens] * full + ([rest] if rest else [])

    def describe(self) -> str:
        return f"fixed {self.tokens} tokens/step"


@dataclass(frozen=True)
class ProfileSteps(StepModel):
    """Forwards per block drawn from a measured histogram (``sangam-bench serve`` writes one),
    the block's positions split evenly over them."""

    steps_per_block: dict[int, int]  # forwards per block -> how many blocks took that many

    def __post_init__(self) -> None:
        if not self.steps_per_block or any(k < 1 or c < 0 for k, c in
                                           self.steps_per_block.items()):
            raise ValueError("steps_per_block needs positive step counts")

    def block_commits(self, rng: random.Random, block_length: int) -> list[int]:
        k = rng.choices(list(self.steps_per_block), list(self.steps_per_block.values()))[0]
        k = min(k, block_length)
        base, extra = divmod(block_length, k)
        return [base + (i < extra) for i in range(k)]

    def describe(self) -> str:
        n = sum(self.steps_per_block.values())
        mean = sum(k * c for k, c in self.steps_per_block.items()) / n
        return f"profile, mean {mean:.2f} forwards/block over {n} blocks"


def load_step_profile(path: str, block_length: int | None = None) -> ProfileSteps:
    """A ``profile.json`` of ``sangam-bench serve``; it must have been recorded at
    ``block_length`` when one is given (forwards per block depend on it)."""
    with open(path) as f:
        data = json.load(f)
    hist = data.get("steps_per_block")
    if not isinstance(hist, dict):
        raise ValueError(f"{path}: no 'steps_per_block' histogram")
    recorded = data.get("block_length")
    if block_length is not None and recorded is not None and recorded != block_length:
        raise ValueError(f"{path} was recorded at block length {recorded}, not {block_length}")
    return ProfileSteps({int(k): int(v) for k, v in hist.items()})

