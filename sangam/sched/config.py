"""One worker's scheduling configuration (docs/design.md §4): a small frozen dataclass,
validated on construction and passed whole. ``EngineConfig`` and the simulator's configuration
take their scheduling fields and defaults from here."""

from __future__ import annotations

import math
from dataclasses import dataclass

POLICIES = ("deficit", "prefill_first", "fastdllm", "adaptive")
DRAIN_ITERATIONS = 1  # adaptive: iterations over which tau would admit the queue's share


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16  # KV page size in tokens
    policy: str = "deficit"
    token_budget: float = 1024  # tau (adaptive: its floor); inf: prefill-first
    max_batch_size: int = 256  # most requests in one forward
    drain_iterations: int = DRAIN_ITERATIONS
    # Block-causal requests: a head whose prefill exceeds the budget left may be admitted in
    # part, its prompt's whole blocks up to the budget (BlockCursor.chunk_room).
    chunked_prefill: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not self.token_budget >= 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if not (math.isinf(self.token_budget) or self.token_budget == int(self.token_budget)):
            raise ValueError(f"token_budget must be a whole number of tokens, got "
                             f"{self.token_budget}")
        if self.drain_iterations < 1:
            raise ValueError(f"drain_iterations must be >= 1, got {self.drain_iterations}")

    @property
    def budget(self) -> int | float:
        """tau as the builder uses it: infinite for prefill-first, else a whole number."""
        if self.policy == "prefill_first" or math.isinf(self.token_budget):
            return math.inf
        return int(self.token_budget)

    @property
    def batch_cap(self) -> int:
        """Most requests in one forward: 1 for the Fast-dLLM baseline."""
        return 1 if self.policy == "fastdllm" else self.max_batch_size


MODES = ("colocated", "disaggregated", "hybrid")
ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class DeploymentConfig:
    """Where requests run (docs/design.md §4, Modes): the serving mode and its workers, each
    scheduling by ``scheduler``. The engine and the simulator both build one."""

    scheduler: SchedulerConfig = SchedulerConfig()
    mode: str = "colocated"
    num_workers: int = 1  # colocated
    prefill_workers: int = 1  # disaggregated / hybrid
    decode_workers: int = 1
    # Hybrid: outstanding prefill tokens (theta) on every prefill worker before a prefill
    # overflows onto a decode worker.
    overflow_threshold: int = 4096
    seed: int = 0  # the router's tie-breaks

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if min(self.num_workers, self.prefill_workers, self.decode_workers) < 1:
            raise ValueError("num_workers, prefill_workers and decode_workers must be >= 1")
        if self.overflow_threshold < 0:
            raise ValueError("overflow_threshold must be >= 0")
        if self.mode != "colocated" and self.scheduler.policy == "fastdllm":
            raise ValueError("the fastdllm policy (batch size 1) has no disaggregated form: use "
                             "mode='colocated'")

    @property
    def roles(self) -> tuple[str, ...]:
        """Each worker's role, workers numbered as the launcher starts them: colocated ones, or
        the prefill workers then the decode workers."""
        if self.mode == "colocated":
            return ("colocated",) * self.num_workers
        return ("prefill",) * self.prefill_workers + ("decode",) * self.decode_workers
