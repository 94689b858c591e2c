"""One simulated deployment: the model, GPU and link, the serving mode and worker counts (each
worker a tensor-parallel group of GPUs), and the engine's and requests' options it shares with
them (defaults taken from theirs)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sangam.bench.cost_model import CALIBRATED, GPUS, LINKS, MODELS
from sangam.config import EngineConfig
from sangam.sampling_params import SamplingParams
from sangam.sched.config import DeploymentConfig, SchedulerConfig
from sangam.sched.window_rings import kv_pool_problem

# The deployment options the simulator shares with the engine take the engine's defaults.
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_REQUEST = SamplingParams()


@dataclass(frozen=True)
class SimConfig:
    model: str = "llada"  # key of cost_model.MODELS, or CALIBRATED
    gpu: str = "h100"  # key of cost_model.GPUS
    mode: str = "colocated"
    num_workers: int = 1  # colocated
    prefill_workers: int = 5  # disaggregated / hybrid
    decode_workers: int = 3
    tensor_parallel_size: int = ENGINE_FIELDS["tensor_parallel_size"].default  # GPUs per worker
    enable_expert_parallel: bool = ENGINE_FIELDS["enable_expert_parallel"].default
    policy: str = ENGINE_FIELDS["policy"].default
    token_budget: float = ENGINE_FIELDS["token_budget"].default
    drain_iterations: int = ENGINE_FIELDS["drain_iterations"].default
    enable_chunked_prefill: bool = ENGINE_FIELDS["enable_chunked_prefill"].default
    enable_prefix_caching: bool | None = ENGINE_FIELDS["enable_prefix_caching"].default
    kv_pool: str = ENGINE_FIELDS["kv_pool"].default
    max_batch_size: int = ENGINE_FIELDS["max_batch_size"].default
    overflow_threshold: int = ENGINE_FIELDS["overflow_threshold"].default
    block_length: int = _REQUEST.block_length
    cache: str = _REQUEST.cache
    refresh_interval: int = _REQUEST.refresh_interval
    prompt_refresh_interval: int = _REQUEST.prompt_refresh_interval
    # Adaptive refresh (SamplingParams.refresh_confidence) has no confidences to read here: the
    # share of the blocks the cadence starts from cache that refresh fully anyway, drawn per
    # (seed, request, block); sangam-bench quality measures it for a refresh_confidence.
    adaptive_refresh_rate: float = 0.0
    # The threshold rule's threshold, and the load-adaptive floor (SamplingParams.min_threshold):
    # with it each block's threshold is the engine's SamplingParams.threshold_under(the worker's
    # load as it starts the block), and a step model per threshold (ThresholdSteps) decides
    # what that block commits; without it every block decodes at ``threshold``.
    threshold: float = _REQUEST.threshold
    min_threshold: float | None = None
    max_tokens: int | None = None  # fixed canvas; None: each request's output length
    page_size: int = ENGINE_FIELDS["page_size"].default
    num_pages: int | None = None  # per worker; None: what the GPU has left after the weights
    memory_fraction: float = ENGINE_FIELDS["gpu_memory_fraction"].default
    link: str = "nvlink"
    layerwise_kv_streaming: bool = ENGINE_FIELDS["layerwise_kv_streaming"].default
    seed: int = ENGINE_FIELDS["seed"].default

    def __post_init__(self) -> None:
        if self.model not in (*MODELS, CALIBRATED):
            raise ValueError(f"model must be one of {[*sorted(MODELS), CALIBRATED]}, got "
                             f"{self.model!r}")
        if self.gpu not in GPUS:
            raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {self.gpu!r}")
        if self.link not in LINKS:
            raise ValueError(f"link must be one of {sorted(LINKS)}, got {self.link!r}")
        if self.model in MODELS:  # a calibrated geometry is checked as the simulator loads it
            MODELS[self.model].check_tensor_parallel(self.tensor_parallel_size,
                                                     self.enable_expert_parallel)
        if problem := kv_pool_problem(self.kv_pool, self.mode, self.enable_prefix_caching):
            raise ValueError(problem)
        if not 0.0 <= self.adaptive_refresh_rate <= 1.0:
            raise ValueError(f"adaptive_refresh_rate must be in [0, 1], got "
                             f"{self.adaptive_refresh_rate}")
        # The deployment's and the requests' checks are the engine's own (modes, worker
        # counts; cadence needs a cache, bounds; what a block-causal model takes): an adaptive
        # refresh rate stands for a refresh_confidence.
        _ = self.deployment
        params = SamplingParams(block_length=self.block_length, cache=self.cache,
                                refresh_interval=self.refresh_interval,
                                prompt_refresh_interval=self.prompt_refresh_interval,
                                refresh_confidence=0.5 if self.adaptive_refresh_rate else 0.0,
                                threshold=self.threshold, min_threshold=self.min_threshold)
        if self.block_causal:
            params.check_block_causal()
        elif self.enable_prefix_caching and self.model in MODELS:
            # (a calibrated geometry may be a uniform-state model's, which caches prefixes)
            raise ValueError("enable_prefix_caching needs a block-causal model (sdar)")

    @property
    def request_params(self) -> SamplingParams:
        """What decides a block's threshold: ``threshold_under(load)`` is the engine's."""
        return SamplingParams(threshold=self.threshold, min_threshold=self.min_threshold)

    @property
    def block_causal(self) -> bool:
        return self.model in MODELS and MODELS[self.model].block_causal

    @property
    def deployment(self) -> DeploymentConfig:
        """The simulated deployment, as the engine's ``EngineConfig.deployment``."""
        scheduler = SchedulerConfig(self.page_size, self.policy, self.token_budget,
                                    self.max_batch_size, self.drain_iterations,
                                    self.enable_chunked_prefill)
        return DeploymentConfig(scheduler, self.mode, self.num_workers, self.prefill_workers,
                                self.decode_workers, self.overflow_threshold, self.seed)

    @property
    def num_gpus(self) -> int:
        return len(self.deployment.roles) * self.tensor_parallel_size

    @property
    def label(self) -> str:
        if self.policy == "fastdllm":
            core = "fastdllm"
        elif self.policy == "adaptive":
            core = f"adaptive tau>={int(self.token_budget)}/{self.drain_iterations}"
        elif math.isinf(self.deployment.scheduler.budget):
            core = "prefill-first"
        else:
            core = f"tau={int(self.token_budget)}"
        if self.mode == "colocated":
            where = f"{self.num_workers}C"
        else:
            where = f"{self.prefill_workers}P{self.decode_workers}" + (
                "D" if self.mode == "disaggregated" else "C")
        if self.tensor_parallel_size > 1:
            where += f" TP{self.tensor_parallel_size}" + (
                " EP" if self.enable_expert_parallel else "")
        cadence = ""
        if (self.refresh_interval, self.prompt_refresh_interval) != (1, 1):
            cadence = f" refresh={self.refresh_interval}/{self.prompt_refresh_interval}"
        if self.adaptive_refresh_rate:
            cadence += f" adaptive={self.adaptive_refresh_rate:g}"
        if self.min_threshold is not None:
            cadence += f" threshold {self.threshold:g}->{self.min_threshold:g}"
        elif self.threshold != _REQUEST.threshold:
            cadence += f" threshold {self.threshold:g}"
        if self.enable_chunked_prefill and self.block_causal:
            cadence += " chunked"
        return f"{where} {core}" + (" lw" if self.layerwise_kv_streaming else "") + cadence
