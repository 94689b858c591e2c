"""Architecture-neutral view of a checkpoint's ``config.json`` (DESIGN.md §6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served as it is; the message says what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "LLaDAModelLM" | "DreamModel"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding / LM head
    mask_token_id: int
    eos_token_id: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context limit for prompt + canvas
    qkv_bias: bool
    shift_logits: bool  # Dream predicts position p from the hidden state at p - 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise CheckpointError(
                f"config.json: hidden size {self.hidden_size} is not a multiple of "
                f"{self.num_heads} attention heads")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: {self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(
                f"config.json: mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"of {self.vocab_size}")


def _get(cfg: dict[str, Any], key: str, arch: str, default: Any = ...) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"config.json ({arch}) is missing the key {key!r}")
    return default


def _first(x: Any) -> int:
    return int(x[0]) if isinstance(x, (list, tuple)) else int(x)


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    """Normalise a LLaDA or Dream ``config.json`` dict; raise CheckpointError naming the problem."""
    archs = cfg.get("architectures")
    if not archs or not isinstance(archs, list):
        raise CheckpointError("config.json has no 'architectures' list")
    arch = archs[0]
    if arch == "LLaDAModelLM":
        g = lambda k, d=...: _get(cfg, k, arch, d)
        n_heads = int(g("n_heads"))
        return ModelConfig(
            architecture=arch,
            hidden_size=int(g("d_model")),
            num_layers=int(g("n_layers")),
            num_heads=n_heads,
            num_kv_heads=int(g("n_kv_heads", n_heads)),
            intermediate_size=int(g("mlp_hidden_size")),
            vocab_size=int(cfg.get("embedding_size") or g("vocab_size")),
            mask_token_id=int(g("mask_token_id", 126336)),
            eos_token_id=_first(g("eos_token_id", 126081)),
            rope_theta=float(g("rope_theta", 10000.0)),
            rms_norm_eps=float(g("rms_norm_eps", 1e-5)),
            max_position=int(g("max_sequence_length", 4096)),
            qkv_bias=bool(cfg.get("include_bias", False) or cfg.get("include_qkv_bias", False)),
            shift_logits=False,
        )
    if arch == "DreamModel":
        g = lambda k, d=...: _get(cfg, k, arch, d)
        n_heads = int(g("num_attention_heads"))
        return ModelConfig(
            architecture=arch,
            hidden_size=int(g("hidden_size")),
            num_layers=int(g("num_hidden_layers")),
            num_heads=n_heads,
            num_kv_heads=int(g("num_key_value_heads", n_heads)),
            intermediate_size=int(g("intermediate_size")),
            vocab_size=int(g("vocab_size")),
            mask_token_id=int(g("mask_token_id", 151666)),
            eos_token_id=_first(g("eos_token_id", 151643)),
            rope_theta=float(g("rope_theta", 1e6)),
            rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
            max_position=int(g("max_position_embeddings", 32768)),
            qkv_bias=True,
            shift_logits=True,
        )
    raise CheckpointError(
        f"config.json: unknown architecture {arch!r}; "
        "Sangam serves 'LLaDAModelLM' and 'DreamModel'")
