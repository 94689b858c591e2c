"""Architecture-neutral view of a checkpoint's ``config.json`` (docs/design.md §6)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served as it is; the message says what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "LLaDAModelLM" | "DreamModel" | "SDARForCausalLM"
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
    head_dim: int = 0  # 0: hidden_size // num_heads (Qwen3 and SDAR name theirs)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, SDAR)
    tie_word_embeddings: bool = False  # the LM head is the embedding (no lm_head tensor)
    # Block-causal models (SDAR): attention is bidirectional within a block of this many
    # positions from position 0 and causal across blocks; requests default to it. 0: fully
    # bidirectional (LLaDA, Dream).
    causal_block_size: int = 0

    @property
    def block_causal(self) -> bool:
        return self.causal_block_size > 0

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise CheckpointError(
                    f"config.json: hidden size {self.hidden_size} is not a multiple of "
                    f"{self.num_heads} attention heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 1 or self.causal_block_size < 0:
            raise CheckpointError(f"config.json: head_dim {self.head_dim} must be positive and "
                                  f"the block size {self.causal_block_size} not negative")
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


def parse_config(cfg: dict[str, Any], source: str | None = None) -> ModelConfig:
    """Normalise a LLaDA, Dream or SDAR ``config.json`` dict (``source``: the directory it was
    read from); raise CheckpointError naming the problem."""
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
        return ModelConfig(
            **_qwen_fields(cfg, arch, mask_token_id=151666, eos_token_id=151643),
            qkv_bias=True,
            shift_logits=True,
        )
    if arch == "SDARForCausalLM":
        g = lambda k, d=...: _get(cfg, k, arch, d)
        qwen = _qwen_fields(cfg, arch, mask_token_id=SDAR_MASK_TOKEN_ID,
                            eos_token_id=SDAR_EOS_TOKEN_ID)
        return ModelConfig(
            **qwen,
            qkv_bias=bool(cfg.get("attention_bias", False)),
            shift_logits=False,
            head_dim=int(g("head_dim", qwen["hidden_size"] // qwen["num_heads"])),
            qk_norm=True,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            causal_block_size=int(g("block_size", g("block_length", sdar_block_size(cfg, source)))),
        )
    raise CheckpointError(
        f"config.json: unknown architecture {arch!r}; "
        "Sangam serves 'LLaDAModelLM', 'DreamModel' and 'SDARForCausalLM'")


def _qwen_fields(cfg: dict[str, Any], arch: str, mask_token_id: int,
                 eos_token_id: int) -> dict[str, Any]:
    """The ModelConfig fields under Qwen's config.json names (Dream, SDAR), with the model's
    default token ids. The hub's SDAR configs carry neither id (SGLang hard-codes the same):
    <|MASK|> and <|im_end|>; the tokenizer adds <|endoftext|> (151643) as a stop id."""
    def g(k, d=...):
        return _get(cfg, k, arch, d)

    n_heads = int(g("num_attention_heads"))
    return dict(
        architecture=arch,
        hidden_size=int(g("hidden_size")),
        num_layers=int(g("num_hidden_layers")),
        num_heads=n_heads,
        num_kv_heads=int(g("num_key_value_heads", n_heads)),
        intermediate_size=int(g("intermediate_size")),
        vocab_size=int(g("vocab_size")),
        mask_token_id=int(g("mask_token_id", mask_token_id)),
        eos_token_id=_first(g("eos_token_id", eos_token_id)),
        rope_theta=float(g("rope_theta", 1e6)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
        max_position=int(g("max_position_embeddings", 32768)),
    )


SDAR_MASK_TOKEN_ID = 151669  # <|MASK|>
SDAR_EOS_TOKEN_ID = 151645  # <|im_end|>
SDAR_BLOCK_SIZE = 4  # the base SDAR models'; the -bN variants are named for theirs


def sdar_block_size(cfg: dict[str, Any], source: str | None = None) -> int:
    """An SDAR checkpoint's block size when config.json does not say: the ``-bN`` suffix of
    its name (``_name_or_path``, or ``source``, the directory it was read from), else 4."""
    for name in (cfg.get("_name_or_path"), source):
        m = re.search(r"-b(\d+)$", str(name or "").rstrip("/"))
        if m:
            return int(m.group(1))
    return SDAR_BLOCK_SIZE
