"""Engine configuration: one frozen dataclass, validated on construction, one CLI flag per field.

The same names are ``LLM(...)`` keyword arguments and ``python -m sangam.serve`` flags
(``token_budget`` <-> ``--token-budget``), as in vLLM and SGLang.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from sangam.sampling_params import CACHE_MODES, UNMASKING_RULES, SamplingParams
from sangam.sched.config import MODES, POLICIES, DeploymentConfig, SchedulerConfig
from sangam.sched.window_rings import KV_POOLS, kv_pool_problem

ATTENTION_BACKENDS = ("torch", "triton")
DTYPE_NAMES = ("auto", "float32", "float64", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
# --quantization: a full-precision checkpoint quantized at load (models.config.ONLINE_QUANTIZATIONS,
# tested equal); --kv-cache-dtype: the model's dtype, or e4m3 values with their scales.
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
EXECUTOR_BACKENDS = ("mp", "ray")
MAX_TRANSFER_TIMEOUT_S = 3600.0  # past this a stuck transfer holds its buffers far too long
MAX_HEARTBEAT_TIMEOUT_S = 600.0  # a partitioned node's requests wait this long at most
MAX_TENSOR_PARALLEL = 64  # ranks per worker: beyond one NVLink domain's GPUs

T = TypeVar("T")

_REQUEST = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
# The scheduling and deployment fields take their defaults from the configs they build.
_SCHED = SchedulerConfig()
_DEPLOY = DeploymentConfig()
# EngineConfig's request defaults, by the SamplingParams field each sets.
REQUEST_DEFAULTS = {"max_tokens_default": "max_tokens", "block_length": "block_length",
                    "unmasking": "unmasking", "threshold": "threshold", "cache": "cache",
                    "refresh_interval": "refresh_interval",
                    "prompt_refresh_interval": "prompt_refresh_interval",
                    "refresh_confidence": "refresh_confidence"}


def _is_ipv4(value: str) -> bool:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def flag_meta(help_: str, aliases: tuple[str, ...] = (), **kw) -> dict:
    """A config field's CLI flag: help, argparse options, and other spellings users know
    (vLLM's)."""
    return {"help": help_, "aliases": aliases, **kw}


def add_config_flags(cls: type, parser: argparse.ArgumentParser,
                     types: Mapping[str, type] | None = None) -> None:
    """One ``--kebab-case`` flag per field of the config dataclass ``cls`` (plus its aliases):
    a bool default makes ``--x/--no-x``, a number default types the flag, and ``types`` types
    the others (fields whose default is None) or overrides."""
    types = types or {}
    for f in dataclasses.fields(cls):
        kw = dict(f.metadata)
        aliases = kw.pop("aliases")
        if f.name in types:
            kw["type"] = types[f.name]
        elif isinstance(f.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, (int, float)):
            kw["type"] = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), *aliases, dest=f.name,
                            default=f.default, **kw)


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The config dataclass ``cls`` from parsed flags (see :func:`add_config_flags`)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(default=None, metadata=flag_meta(
        "Local checkpoint directory in Hugging Face layout, or the name of a shipped demo model "
        "(sangam-demo, the default)"))
    tokenizer: str | None = field(default=None, metadata=flag_meta(
        "Directory of the tokenizer files (default: the checkpoint's own, if any)"))
    load_format: str = field(default="auto", metadata=flag_meta(
        "auto: the checkpoint's safetensors; dummy: random weights of config.json's shape, "
        "built on the device (only config.json is read: for benchmarking a model's shape "
        "without its weights)", choices=LOAD_FORMATS))
    device: str | None = field(default=None, metadata=flag_meta(
        "'cpu' or 'cuda' (default: cuda when available)"))
    dtype: str = field(default="auto", metadata=flag_meta(
        "Model dtype: auto (bfloat16 on GPU, float32 on CPU), float32, float64, bfloat16, "
        "float16", choices=DTYPE_NAMES))
    quantization: str | None = field(default=None, metadata=flag_meta(
        "fp8: quantize a full-precision checkpoint's linear layers to FP8 at load (one scale "
        "per output channel, activations per token and group of 128). FP8 checkpoints "
        "(quantization_config) need no flag", choices=QUANTIZATIONS))
    kv_cache_dtype: str = field(default="auto", metadata=flag_meta(
        "KV cache: auto (the model's dtype) or fp8 (e4m3, each token's head with its own "
        "scale: about half the bytes a page, twice the pages)", choices=KV_CACHE_DTYPES))
    kv_pool: str = field(default="auto", metadata=flag_meta(
        "KV pool of a model with sliding-window layers (DiffusionGemma): hybrid keeps only "
        "each request's last window of those layers (a ring of pages; prompts stored in "
        "chunks; no prefix caching, colocated workers only), single holds every position in "
        "every layer; auto: hybrid where prefix caching is off and workers are colocated",
        choices=KV_POOLS))
    attention_backend: str | None = field(default=None, metadata=flag_meta(
        "Attention implementation: triton (GPU default) or torch (CPU default)",
        choices=ATTENTION_BACKENDS))
    page_size: int = field(default=_SCHED.page_size, metadata=flag_meta(
        "KV page size in tokens"))
    num_pages: int | None = field(default=None, metadata=flag_meta(
        "KV pool size in pages (default: from --gpu-memory-fraction on GPU, "
        "--cpu-kv-cache-gb on CPU)"))
    gpu_memory_fraction: float = field(default=0.9, metadata=flag_meta(
        "Fraction of GPU memory for weights + KV pool", aliases=("--gpu-memory-utilization",)))
    cpu_kv_cache_gb: float = field(default=2.0, metadata=flag_meta(
        "KV pool size on CPU, GiB, when --num-pages is not given"))
    policy: str = field(default=_SCHED.policy, metadata=flag_meta(
        "Scheduling policy: deficit token budget, prefill_first (tau = infinity), fastdllm "
        "(batch size 1, each request to completion), or adaptive (deficit, tau raised to the "
        "waiting prefill tokens times the queue's share of the requests, over "
        "--drain-iterations; --token-budget its floor)",
        choices=POLICIES))
    token_budget: float = field(default=_SCHED.token_budget, metadata=flag_meta(
        "Deficit token budget tau per iteration ('inf' = prefill-first; adaptive: the floor)"))
    drain_iterations: int = field(default=_SCHED.drain_iterations, metadata=flag_meta(
        "adaptive policy: tau admits the queue's share of the waiting prefill tokens over "
        "this many iterations"))
    enable_chunked_prefill: bool = field(default=_SCHED.chunked_prefill, metadata=flag_meta(
        "Block-causal models (SDAR): admit a prompt's prefill in chunks of whole blocks within "
        "the token budget, instead of whole when the budget covers it"))
    enable_prefix_caching: bool | None = field(default=None, metadata=flag_meta(
        "Block-causal models (SDAR, LLaDA2) and uniform-state ones (DiffusionGemma): reuse "
        "the K/V pages of prompt blocks an earlier request computed (default: on for them; a "
        "bidirectional model has no exact prompt K/V, so it is refused there)",
        action=argparse.BooleanOptionalAction))
    max_model_len: int | None = field(default=None, metadata=flag_meta(
        "Longest prompt + response canvas a request may have (default: the model's context); "
        "CUDA-graph block tables are sized for it"))
    max_batch_size: int = field(default=_SCHED.max_batch_size, metadata=flag_meta(
        "Most requests in one forward (seated decodes plus admitted prefills)",
        aliases=("--max-num-seqs",)))
    enforce_eager: bool = field(default=False, metadata=flag_meta(
        "Never capture CUDA graphs (by default decode batches of the model's block length "
        "replay graphs on GPU with the triton backend)"))
    max_queue_len: int = field(default=1024, metadata=flag_meta(
        "Most requests waiting or running; beyond it new requests are refused (HTTP 503)"))
    mode: str = field(default=_DEPLOY.mode, metadata=flag_meta(
        "Multi-worker serving mode: colocated, disaggregated (prefill/decode workers) or hybrid "
        "(disaggregated + prefill overflow onto decode workers)", choices=MODES))
    num_workers: int = field(default=_DEPLOY.num_workers, metadata=flag_meta(
        "Worker processes (one per GPU; CPU processes without GPUs) in colocated mode"))
    tensor_parallel_size: int = field(default=1, metadata=flag_meta(
        "GPUs (CPU processes) per worker: each worker is a group of this many ranks that split "
        "every forward (Megatron tensor parallelism over NCCL; gloo on CPU), in every mode",
        aliases=("-tp", "--tp", "--tp-size")))
    enable_expert_parallel: bool = field(default=False, metadata=flag_meta(
        "Mixture-of-experts models under --tensor-parallel-size: split the experts across the "
        "ranks instead of each expert's width"))
    devices: str | None = field(default=None, metadata=flag_meta(
        "Explicit comma-separated device list for the workers, e.g. cuda:0,cuda:1"))
    prefill_workers: int = field(default=_DEPLOY.prefill_workers, metadata=flag_meta(
        "Prefill workers in disaggregated / hybrid mode"))
    decode_workers: int = field(default=_DEPLOY.decode_workers, metadata=flag_meta(
        "Decode workers in disaggregated / hybrid mode"))
    overflow_threshold: int = field(default=_DEPLOY.overflow_threshold, metadata=flag_meta(
        "Hybrid mode: outstanding prefill tokens (theta) on every prefill worker before a "
        "prefill overflows onto a decode worker"))
    layerwise_kv_streaming: bool = field(default=False, metadata=flag_meta(
        "Disaggregated modes: send each layer's K/V while the next layer computes"))
    nnodes: int = field(default=1, metadata=flag_meta("Number of nodes (hosts) serving together"))
    node_rank: int = field(default=0, metadata=flag_meta(
        "This node's rank; node 0 runs the front process"))
    dist_init_addr: str | None = field(default=None, metadata=flag_meta(
        "host:port of node 0 for joining workers across nodes"))
    node_ip: str | None = field(default=None, metadata=flag_meta(
        "Multi-node: this node's IPv4 address for the data plane (gloo, NCCL's bootstrap); "
        "default: the local address that routes to --dist-init-addr"))
    network_interface: str | None = field(default=None, metadata=flag_meta(
        "Multi-node: the network interface for the data plane (as GLOO_SOCKET_IFNAME / "
        "NCCL_SOCKET_IFNAME, which are respected when set); it must carry the route to "
        "--dist-init-addr"))
    distributed_executor_backend: str = field(default="mp", metadata=flag_meta(
        "How worker processes start: mp (forked on this node; other nodes run "
        "`python -m sangam.engine.multi.node`), or ray (actors placed on an existing Ray "
        "cluster's nodes, one placement group per worker; RAY_ADDRESS or a local cluster)",
        choices=EXECUTOR_BACKENDS))
    heartbeat_timeout: float = field(default=10.0, metadata=flag_meta(
        "Multi-node: seconds without a heartbeat (sent every 0.5 s) before a worker on "
        "another node is declared dead and its requests placed elsewhere, and before a worker "
        "that cannot hear the front stops (a partition)"))
    watchdog_timeout: float = field(default=300.0, metadata=flag_meta(
        "Multi-worker: seconds a worker with work may go without a report from its loop "
        "(which reports at least every second while it has work) and without computing (its "
        "heartbeats carry the loop's CPU time) before it is declared hung, stopped, and its "
        "requests are placed elsewhere; a loop that computes is given 10x as long"))
    transfer_timeout: float = field(default=120.0, metadata=flag_meta(
        "Multi-worker: seconds a K/V transfer's send or receive may wait for its peer before "
        "it fails (and the request is placed again); the timeout of each sender-receiver "
        f"pair's process group (at most {MAX_TRANSFER_TIMEOUT_S:g})"))
    transfer_buffer_bytes: int = field(default=1 << 30, metadata=flag_meta(
        "Multi-worker: bytes of K/V transfer buffers a worker may hold at once (gathered "
        "sends and pending receives), beside the KV pool: a receive that does not fit waits "
        "its turn, a sender over it runs no forward until its sends drain; on GPU, "
        "disaggregated and hybrid workers reserve it before the pool is sized"))
    seed: int = field(default=_DEPLOY.seed, metadata=flag_meta(
        "Seed of the engine's own randomness (router tie-breaks, seeds for unseeded sampling)"))
    # Defaults of requests that leave these options out (the server's, and LLM's
    # get_default_sampling_params). Unset (None): the checkpoint's generation_config.json,
    # else SamplingParams' own defaults. Merged by LoadedModel.default_params.
    max_tokens_default: int | None = field(default=None, metadata=flag_meta(
        "max_tokens of requests that do not set it (default: the checkpoint's "
        f"generation_config.json max_new_tokens, else {_REQUEST['max_tokens']})"))
    block_length: int | None = field(default=None, metadata=flag_meta(
        "Default block length B (default: generation_config.json, else "
        f"{_REQUEST['block_length']})"))
    unmasking: str | None = field(default=None, metadata=flag_meta(
        f"Default unmasking rule (default: {_REQUEST['unmasking']})", choices=UNMASKING_RULES))
    threshold: float | None = field(default=None, metadata=flag_meta(
        f"Default confidence threshold (default: {_REQUEST['threshold']})"))
    cache: str | None = field(default=None, metadata=flag_meta(
        f"Default KV cache mode (default: {_REQUEST['cache']})", choices=CACHE_MODES))
    refresh_interval: int | None = field(default=None, metadata=flag_meta(
        "Default refresh interval: blocks start with a refresh only every this many (the "
        f"others with a cached step; default: {_REQUEST['refresh_interval']}, every block)"))
    prompt_refresh_interval: int | None = field(default=None, metadata=flag_meta(
        "Default prompt refresh interval: every this-many-th refresh is full, the others "
        "recompute only the response's K/V [P, T) (default: "
        f"{_REQUEST['prompt_refresh_interval']}, all full)"))
    refresh_confidence: float | None = field(default=None, metadata=flag_meta(
        "Default adaptive-refresh confidence: a block the cadence starts from cache refreshes "
        "fully when the block before committed a token below it (default: "
        f"{_REQUEST['refresh_confidence']}, never)"))
    cuda_graph_block_lengths: str | None = field(default=None, metadata=flag_meta(
        "Comma-separated block lengths whose decode steps replay CUDA graphs (one capture "
        "each; default: the default block length); other lengths run eagerly"))

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"EngineConfig: {msg}")

        need(self.device in (None, "cpu", "cuda") or str(self.device).startswith("cuda:"),
             f"device must be 'cpu' or 'cuda', got {self.device!r}")
        need(self.load_format in LOAD_FORMATS,
             f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        problem = kv_pool_problem(self.kv_pool, self.mode, self.enable_prefix_caching)
        need(problem is None, problem or "")
        need(self.quantization in (None, *QUANTIZATIONS),
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        need(self.dtype in DTYPE_NAMES, f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        need(self.attention_backend in (None, *ATTENTION_BACKENDS),
             f"attention_backend must be one of {ATTENTION_BACKENDS}")
        need(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
             f"page_size must be a power of two, got {self.page_size}")
        need(self.num_pages is None or self.num_pages >= 1, "num_pages must be >= 1")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        need(0.0 < self.gpu_memory_fraction <= 1.0, "gpu_memory_fraction must be in (0, 1]")
        need(self.cpu_kv_cache_gb > 0, "cpu_kv_cache_gb must be > 0")
        need(self.max_queue_len >= 1, "max_queue_len must be >= 1")
        need(self.watchdog_timeout > 0, "watchdog_timeout must be > 0")
        need(0 < self.transfer_timeout <= MAX_TRANSFER_TIMEOUT_S,
             f"transfer_timeout must be in (0, {MAX_TRANSFER_TIMEOUT_S:g}]")
        need(self.transfer_buffer_bytes > 0, "transfer_buffer_bytes must be > 0")
        need(1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL,
             f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL}]")
        try:
            self.deployment  # noqa: B018  (validates the scheduling and deployment fields)
        except ValueError as e:
            raise ValueError(f"EngineConfig: {e}") from None
        need(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
             f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}")
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             "dist_init_addr (host:port of node 0) is required when nnodes > 1")
        need(self.distributed_executor_backend in EXECUTOR_BACKENDS,
             f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}")
        ray = self.distributed_executor_backend == "ray"
        need(not ray or (self.nnodes == 1 and not self.devices
                         and ":" not in (self.device or "")),
             "distributed_executor_backend ray places the workers on the Ray cluster's nodes "
             "and devices: give neither nnodes, devices nor a device index")
        need(self.node_ip is None or (_is_ipv4(self.node_ip) and self.nnodes > 1),
             f"node_ip must be an IPv4 address of a multi-node deployment's node (nnodes > 1), "
             f"got {self.node_ip!r}")
        need(self.network_interface is None or self.nnodes > 1 or ray,
             "network_interface applies to workers on several nodes (nnodes > 1, or the ray "
             "backend)")
        need(1.0 <= self.heartbeat_timeout <= MAX_HEARTBEAT_TIMEOUT_S,
             f"heartbeat_timeout must be in [1, {MAX_HEARTBEAT_TIMEOUT_S:g}]")
        SamplingParams(**self.request_defaults())  # bad defaults fail here, at startup
        lengths = self.graph_block_lengths()
        need(all(n >= 1 for n in lengths), f"cuda_graph_block_lengths must be integers >= 1, "
             f"got {self.cuda_graph_block_lengths!r}")

    def request_defaults(self) -> dict[str, object]:
        """The request defaults set here, by SamplingParams field name."""
        return {ours: getattr(self, name) for name, ours in REQUEST_DEFAULTS.items()
                if getattr(self, name) is not None}

    def graph_block_lengths(self) -> tuple[int, ...]:
        """``cuda_graph_block_lengths`` parsed (empty: unset)."""
        given = self.cuda_graph_block_lengths
        try:
            return tuple(int(x) for x in given.split(",") if x.strip()) if given else ()
        except ValueError:
            raise ValueError(f"EngineConfig: cuda_graph_block_lengths must be comma-separated "
                             f"integers, got {given!r}") from None

    @property
    def scheduler(self) -> SchedulerConfig:
        """Each worker's scheduling."""
        return SchedulerConfig(self.page_size, self.policy, self.token_budget,
                               self.max_batch_size, self.drain_iterations,
                               self.enable_chunked_prefill)

    @property
    def device_list(self) -> list[str]:
        """``devices`` split: the workers' devices, in order (empty: unset)."""
        return [d.strip() for d in self.devices.split(",") if d.strip()] if self.devices else []

    @property
    def deployment(self) -> DeploymentConfig:
        """The serving mode and its workers ("--devices cuda:0,cuda:1" alone means two
        colocated workers)."""
        num_workers = self.num_workers
        if num_workers == 1 and self.nnodes == 1 and len(self.device_list) > 1:
            num_workers = len(self.device_list)
        return DeploymentConfig(self.scheduler, self.mode, num_workers, self.prefill_workers,
                                self.decode_workers, self.overflow_threshold, self.seed)

    @property
    def is_multi_worker(self) -> bool:
        """Whether the workers run in processes of their own: several workers, another mode
        or node, a worker of several tensor-parallel ranks, or Ray actors."""
        return (len(self.deployment.roles) > 1 or self.mode != "colocated" or self.nnodes > 1
                or self.tensor_parallel_size > 1 or self.distributed_executor_backend == "ray")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        # token_budget: a float flag, so that "inf" parses.
        add_config_flags(cls, parser, {"token_budget": float, "num_pages": int,
                                       "max_model_len": int, "max_tokens_default": int,
                                       "block_length": int, "threshold": float,
                                       "refresh_interval": int,
                                       "prompt_refresh_interval": int,
                                       "refresh_confidence": float})

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """An EngineConfig from keyword options (``LLM(...)``, ``AsyncEngine(...)``): its field
        names, or vLLM's names of the same options (``gpu_memory_utilization``,
        ``max_num_seqs``), so vLLM code runs. An unknown name is a TypeError."""
        names = {f.name: f.name for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(cls):
            for alias in f.metadata["aliases"]:
                names[alias.removeprefix("--").replace("-", "_")] = f.name
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown options {unknown}; valid: {sorted(names)}")
        resolved: dict[str, object] = {}
        for given, value in options.items():
            if names[given] in resolved:
                raise TypeError(f"{names[given]} is given twice (once as {given})")
            resolved[names[given]] = value
        return cls(**resolved)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return config_from_args(cls, args)

