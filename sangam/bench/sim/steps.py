"""The tokens each forward of a simulated block commits, where a real model's confidences would
decide: fixed, geometric, the histogram a ``sangam-bench serve`` run recorded, or the per-mode
commit profiles a ``sangam-bench quality --profiles`` sweep recorded (:func:`load_mode_profiles`),
one per threshold for the load-adaptive threshold (:class:`ThresholdSteps`).

A simulated forward costs what its span costs, not what it commits: what a step model decides is
how many forwards each block takes (and so how many LM-head rows each carries)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass


class StepModel:
    """How many positions each forward of a block commits (a refresh is the first step).
    ``block`` is the block's index in the response (0: the one after the prompt), ``threshold``
    the threshold the block decodes at (a load-adaptive request's depends on the load); models
    that do not depend on them ignore them."""

    def block_commits(self, rng: random.Random, block_length: int, block: int = 0,
                      threshold: float | None = None) -> list[int]:
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

    def block_commits(self, rng: random.Random, block_length: int, block: int = 0,
                      threshold: float | None = None) -> list[int]:
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

    def block_commits(self, rng: random.Random, block_length: int, block: int = 0,
                      threshold: float | None = None) -> list[int]:
        full, rest = divmod(block_length, self.tokens)
        return [self.tokens] * full + ([rest] if rest else [])

    def describe(self) -> str:
        return f"fixed {self.tokens} tokens/step"


MIN_BLOCK_SAMPLES = 20  # a block index measured on fewer blocks draws from the pooled ones


def _split(block_length: int, k: int) -> list[int]:
    k = max(1, min(k, block_length))
    base, extra = divmod(block_length, k)
    return [base + (i < extra) for i in range(k)]


def _draw(rng: random.Random, hist: dict[int, int]) -> int:
    return rng.choices(list(hist), list(hist.values()))[0]


@dataclass(frozen=True)
class ProfileSteps(StepModel):
    """Forwards per block drawn from a measured histogram, the block's positions split evenly
    over them.

    ``sangam-bench serve`` writes one histogram (``steps_per_block``), applied as is at the
    block length it was recorded at. ``sangam-bench quality --profiles`` writes one per block
    index of the response (``by_block``) and the block length it decoded at
    (``block_length``): a block of index b draws from index b's histogram (from the pooled
    blocks of index >= 1 when index b has fewer than ``MIN_BLOCK_SAMPLES`` blocks, or was
    never reached), and at another block length B the drawn block's tokens per forward is kept:
    a recorded block of ``block_length`` positions that took k forwards makes a block of B
    take B * k / ``block_length`` forwards (rounded at random to a neighbouring integer, so the
    mean is kept). The assumption: a block's tokens per forward does not depend on its length
    (the measured model decodes at its own block length, the simulated one at another)."""

    steps_per_block: dict[int, int]  # forwards per block -> how many blocks took that many
    block_length: int | None = None  # recorded at; None: forwards per block applied as is
    by_block: tuple[dict[int, int], ...] = ()  # per block index of the response
    scale: float = 1.0  # tokens per forward multiplied by this (forwards per block divided)

    def __post_init__(self) -> None:
        if not self.steps_per_block or any(k < 1 or c < 0 for k, c in
                                           self.steps_per_block.items()):
            raise ValueError("steps_per_block needs positive step counts")
        if not self.scale > 0:
            raise ValueError(f"scale must be positive, got {self.scale}")
        if self.block_length is not None and self.block_length < 1:
            raise ValueError(f"block_length must be positive, got {self.block_length}")

    @classmethod
    def from_blocks(cls, by_block: list[dict[int, int]], block_length: int) -> ProfileSteps:
        """From per-block-index histograms (a quality profile's ``forwards_per_block``)."""
        total: dict[int, int] = {}
        for h in by_block:
            for k, c in h.items():
                total[k] = total.get(k, 0) + c
        return cls(total, block_length, tuple(by_block))

    def _later(self) -> dict[int, int]:
        pooled: dict[int, int] = {}
        for h in self.by_block[1:]:
            for k, c in h.items():
                pooled[k] = pooled.get(k, 0) + c
        return pooled or self.steps_per_block

    def histogram(self, block: int) -> dict[int, int]:
        """The histogram a block of index ``block`` draws from."""
        if not self.by_block:
            return self.steps_per_block
        if block < len(self.by_block) and sum(self.by_block[block].values()) >= MIN_BLOCK_SAMPLES:
            return self.by_block[block]
        return self._later() if block > 0 else self.steps_per_block

    def block_commits(self, rng: random.Random, block_length: int, block: int = 0,
                      threshold: float | None = None) -> list[int]:
        k = _draw(rng, self.histogram(block))
        ratio = (1.0 if self.block_length is None else block_length / self.block_length)
        if ratio / self.scale != 1.0:
            x = k * ratio / self.scale
            k = int(x) + (rng.random() < x - int(x))
        return _split(block_length, k)

    def mean_tokens_per_forward(self, block_length: int | None = None) -> float:
        """Positions over forwards, pooled over the blocks recorded."""
        n = sum(self.steps_per_block.values())
        forwards = sum(k * c for k, c in self.steps_per_block.items())
        return (self.block_length or block_length or 1) * n / forwards * self.scale

    def describe(self) -> str:
        n = sum(self.steps_per_block.values())
        mean = sum(k * c for k, c in self.steps_per_block.items()) / n
        at = (f" of {self.block_length}, {self.mean_tokens_per_forward():.2f} tokens/forward"
              if self.block_length else "")
        if self.scale != 1.0:
            at += f" (scaled x{self.scale:.3g})"
        return f"profile, mean {mean:.2f} forwards/block{at} over {n} blocks"


@dataclass(frozen=True)
class ThresholdSteps(StepModel):
    """One step model per threshold (profiles measured at several): a block decoding at
    threshold t draws from the neighbouring measured thresholds' models, the nearer one more
    often (at random, weights linear in t: a mixture that interpolates their distributions);
    outside the measured range, from the nearest. What the load-adaptive threshold serves with:
    the simulator asks the engine's ``SamplingParams.threshold_under`` for each block's
    threshold."""

    by_threshold: dict[float, StepModel]

    def __post_init__(self) -> None:
        if not self.by_threshold:
            raise ValueError("ThresholdSteps needs at least one threshold's step model")

    def model_for(self, rng: random.Random, threshold: float | None) -> StepModel:
        ts = sorted(self.by_threshold)
        if threshold is None or threshold >= ts[-1]:
            return self.by_threshold[ts[-1]]
        if threshold <= ts[0]:
            return self.by_threshold[ts[0]]
        hi = next(t for t in ts if t >= threshold)
        lo = max(t for t in ts if t <= threshold)
        if hi == lo:
            return self.by_threshold[hi]
        return self.by_threshold[hi if rng.random() < (threshold - lo) / (hi - lo) else lo]

    def block_commits(self, rng: random.Random, block_length: int, block: int = 0,
                      threshold: float | None = None) -> list[int]:
        return self.model_for(rng, threshold).block_commits(rng, block_length, block, threshold)

    def describe(self) -> str:
        return "per threshold: " + "; ".join(f"{t:g}: {m.describe()}"
                                             for t, m in sorted(self.by_threshold.items()))


def load_step_profile(path: str, block_length: int | None = None) -> ProfileSteps:
    """A ``profile.json`` of ``sangam-bench serve``; it must have been recorded at
    ``block_length`` when one is given (forwards per block depend on it). ``FILE#MODE``: the
    mode MODE of a ``sangam-bench quality --json`` of a uniform-state model (its forwards per
    canvas, at the model's canvas length)."""
    path, _, mode = path.partition("#")
    with open(path) as f:
        data = json.load(f)
    if mode:
        entry = data.get("modes", {}).get(mode)
        if entry is None:
            raise ValueError(f"{path} has no mode {mode!r} (its modes: "
                             f"{sorted(data.get('modes', {}))})")
        return ProfileSteps({int(k): int(v) for k, v in entry["steps_per_block"].items()})
    hist = data.get("steps_per_block")
    if not isinstance(hist, dict):
        raise ValueError(f"{path}: no 'steps_per_block' histogram")
    recorded = data.get("block_length")
    if block_length is not None and recorded is not None and recorded != block_length:
        raise ValueError(f"{path} was recorded at block length {recorded}, not {block_length}")
    return ProfileSteps({int(k): int(v) for k, v in hist.items()})



@dataclass(frozen=True)
class ModeProfile:
    """One mode of a ``sangam-bench quality --profiles`` file: its step model, its options and
    what it measured (exact match, block agreement, the boundary refresh rate)."""

    name: str
    steps: ProfileSteps
    threshold: float
    refresh_interval: int
    prompt_refresh_interval: int
    refresh_confidence: float
    boundary_refresh_rate: float | None
    tokens_per_forward: float
    accuracy: float | None = None
    block_agreement: float | None = None


def mode_profile(name: str, entry: dict) -> ModeProfile:
    """One entry of a profiles file (``sangam.bench.quality.commit_profile`` plus its scores)."""
    try:
        hists = [{int(k): int(v) for k, v in h.items()} for h in entry["forwards_per_block"]]
        steps = ProfileSteps.from_blocks(hists, int(entry["block_length"]))
        return ModeProfile(name, steps, float(entry["threshold"]),
                           int(entry["refresh_interval"]), int(entry["prompt_refresh_interval"]),
                           float(entry.get("refresh_confidence") or 0.0),
                           entry.get("boundary_refresh_rate"), float(entry["tokens_per_forward"]),
                           entry.get("accuracy"), entry.get("block_agreement"))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"profile {name!r}: not a commit profile ({e})") from None


def load_mode_profiles(path: str) -> dict[str, ModeProfile]:
    """Mode name -> its profile, from a ``sangam-bench quality --profiles`` file."""
    with open(path) as f:
        data = json.load(f)
    modes = data.get("modes") if isinstance(data, dict) else None
    if not isinstance(modes, dict) or not modes:
        raise ValueError(f"{path}: no 'modes' (write it with sangam-bench quality --profiles)")
    return {name: mode_profile(name, entry) for name, entry in modes.items()
            if entry.get("forwards_per_block")}
