"""A model ready to serve: its weights on their device, its text codec (``text.py``), the ids
that end a response, the request defaults it suggests, and its context."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sangam.config import EngineConfig
from sangam.decoding.grammar import GrammarCompiler, compiler_for, register_tokenizer
from sangam.engine.text import TextCodec
from sangam.models import (
    AttentionBackend,
    CheckpointError,
    DiffusionLM,
    ModelConfig,
    ShardLayout,
    load_model,
    load_tokenizer,
    read_config,
    stop_token_ids,
)
from sangam.models.kernel_table import backend_name, kernel_table
from sangam.models.loader import with_quantization
from sangam.sampling_params import MASKED_ONLY_FIELDS, UNIFORM_FIELDS, SamplingParams


def default_device() -> str:
    """cuda when a GPU is visible, else cpu. Counted through NVML where it works, which leaves
    CUDA uninitialized (``torch.cuda.is_available`` would not): a process that asks may still
    fork workers that use CUDA, as a multi-worker node does."""
    return "cuda" if torch.cuda.device_count() > 0 else "cpu"


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (a no-op elsewhere). Triton
    launches kernels, and CUDA graphs capture, on the current device's stream, and the current
    device is per thread: a model on cuda:1 run from a thread still on cuda:0 would be handed
    cuda:0 streams (an illegal memory access, or a failed capture)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def checkpoint_path(cfg: EngineConfig) -> str | Path:
    """``cfg.model``: a checkpoint directory, or a shipped demo model's name (a directory of
    that name wins); None: the default demo model."""
    from sangam.demo import DEMO_MODELS, demo_model_path

    if cfg.model is None:
        return demo_model_path()
    if cfg.model in DEMO_MODELS and not Path(cfg.model).is_dir():
        return demo_model_path(cfg.model)
    return cfg.model


def context_limit(cfg: EngineConfig, model_config: ModelConfig) -> int | None:
    """``cfg.max_model_len``, checked against the model's context (positions beyond it were
    never trained and have no RoPE table)."""
    if cfg.max_model_len is not None and cfg.max_model_len > model_config.max_position:
        raise ValueError(f"max_model_len {cfg.max_model_len} is beyond the model's context of "
                         f"{model_config.max_position}")
    return cfg.max_model_len


def make_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """``None`` picks triton on GPU and the PyTorch reference on CPU (docs/design.md §5)."""
    return kernel_table(backend_name(device, name)).attention()


GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that become SamplingParams defaults (HF name -> ours).
GENERATION_KEYS = {"max_new_tokens": "max_tokens", "block_length": "block_length",
                   "unmasking": "unmasking", "threshold": "threshold", "factor": "factor",
                   "tokens_per_step": "tokens_per_step", "cache": "cache",
                   **{name: name for name in UNIFORM_FIELDS}}


def generation_eos_ids(path: str | Path) -> frozenset[int]:
    """The ``eos_token_id`` (one, or a list) of a checkpoint's ``generation_config.json``:
    transformers' generate stops at each (DiffusionGemma lists its end of turn there)."""
    f = Path(path) / GENERATION_CONFIG
    if not f.is_file():
        return frozenset()
    ids = json.loads(f.read_text()).get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool)
                     and 0 <= i < 2**31)


def read_generation_defaults(path: str | Path) -> dict:
    """SamplingParams defaults a checkpoint suggests in its ``generation_config.json`` (e.g. a
    model trained on short responses): only the keys Sangam understands, validated."""
    f = Path(path) / GENERATION_CONFIG
    if not f.is_file():
        return {}
    raw = json.loads(f.read_text())
    # DiffusionGemma's entropy bound sits in its sampler's config; a null is transformers'
    # "unset" (its own default applies).
    sampler = raw.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        raw = {**raw, "entropy_bound": sampler["entropy_bound"]}
    defaults = {ours: raw[theirs] for theirs, ours in GENERATION_KEYS.items()
                if raw.get(theirs) is not None}
    SamplingParams(**defaults)  # a broken file fails at load time, naming the key
    return defaults


def check_deployment(cfg: EngineConfig, model_config: ModelConfig, path: str | Path) -> None:
    """Raise for a server flag this model cannot take: ``--quantization`` on a checkpoint
    quantized already; a uniform-state model's (DiffusionGemma) masked-diffusion options."""
    with_quantization(model_config, cfg.quantization)  # raises where the flag cannot apply
    masked = sorted(set(cfg.request_defaults()) & set(MASKED_ONLY_FIELDS))
    if model_config.gemma is not None and masked:
        raise CheckpointError(f"{path}: {model_config.architecture} (uniform-state diffusion): "
                              f"the masked-diffusion options {masked} do not apply to it")


@dataclass
class LoadedModel:
    path: str
    model: DiffusionLM | None  # None in a multi-worker front, which never runs the model
    config: ModelConfig
    text: TextCodec  # the tokenizer (which may be absent)
    stop_ids: frozenset[int]
    device: torch.device
    dtype: torch.dtype
    # Request defaults: the checkpoint's generation_config.json, then EngineConfig's.
    request_defaults: dict = field(default_factory=dict)
    max_model_len: int | None = None  # EngineConfig.max_model_len, checked by context_limit
    tokenizer_path: str | None = None  # where the tokenizer was read (checkpoint, --tokenizer)

    @classmethod
    def load(cls, cfg: EngineConfig, shard: ShardLayout = ShardLayout()) -> LoadedModel:
        """The checkpoint of ``cfg`` on its device (``shard``: one rank's slice of it)."""
        path = checkpoint_path(cfg)
        device = torch.device(cfg.device or default_device())
        check_deployment(cfg, read_config(path), path)  # before reading the weights
        model = load_model(path, device, None if cfg.dtype == "auto" else cfg.dtype,
                           cfg.load_format, shard, cfg.quantization)
        model.attention_backend = make_attention_backend(cfg.attention_backend, device)
        p = model.head_weight()  # never FP8: the model's dtype
        return cls.around(cfg, path, model, model.config, p.device, p.dtype)

    @classmethod
    def around(cls, cfg: EngineConfig, path: str | Path, model: DiffusionLM | None,
               model_config: ModelConfig, device: torch.device, dtype: torch.dtype
               ) -> LoadedModel:
        """``model`` (None on a front whose workers hold the weights) with the checkpoint's
        tokenizer (or ``cfg.tokenizer``'s), stop ids, request defaults and context limit."""
        check_deployment(cfg, model_config, path)
        tokenizer = load_tokenizer(cfg.tokenizer or path, required=cfg.tokenizer is not None)
        if tokenizer is not None:  # for structured output, in this process
            register_tokenizer(str(cfg.tokenizer or path), tokenizer)
        # A block-causal model's requests default to the block size it was trained with, and
        # every model's to its own generate's defaults.
        trained = ({"block_length": model_config.causal_block_size}
                   if model_config.block_causal else {})
        trained.update(model_config.request_defaults)
        return cls(str(path), model, model_config, TextCodec(tokenizer),
                   stop_token_ids(model_config.eos_token_id, tokenizer)
                   | generation_eos_ids(path), device, dtype,
                   {**trained, **read_generation_defaults(path), **cfg.request_defaults()},
                   context_limit(cfg, model_config),
                   None if tokenizer is None else str(cfg.tokenizer or path))

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler over this model's tokenizer (one per process and
        tokenizer; compiled constraints are cached in it)."""
        if self.tokenizer_path is None:
            raise ValueError("structured output needs a tokenizer and this checkpoint has none")
        return compiler_for(self.tokenizer_path, self.config.vocab_size,
                            self.config.eos_token_id)

    def uniform_defaults(self) -> dict:
        """A uniform-state model's denoising defaults (its generation_config.json's)."""
        return {k: v for k, v in self.request_defaults.items() if k in UNIFORM_FIELDS}

    def default_params(self, **overrides) -> SamplingParams:
        """A request's SamplingParams: the one place its defaults merge. The checkpoint's
        generation_config.json, then the engine's flags (--block-length...), then
        ``overrides`` (a request's own fields)."""
        return SamplingParams(**{**self.request_defaults, **overrides})

    @property
    def context_length(self) -> int:
        """The longest prompt + canvas a request may have: the model's, or --max-model-len."""
        return self.max_model_len or self.config.max_position
