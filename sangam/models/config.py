"""A model's architecture-neutral configuration (``ModelConfig``, ``MoeConfig``): what every
forward, KV pool and memory plan reads. ``checkpoint.py`` builds it from a checkpoint's
``config.json`` (docs/design.md §6)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The experts' gate activations the kernels implement (``kernels.reference.MOE_ACTIVATIONS``,
# tested equal; this module stays free of PyTorch).
EXPERT_ACTIVATIONS = ("silu", "gelu_tanh")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served as it is; the message says what is wrong."""


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: the router's rule and the experts' shape (every MoE layer of a
    model shares it)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each routed expert's SwiGLU width
    shared_intermediate_size: int  # the always-on shared experts' width together; 0: none
    score: str  # "sigmoid" (LLaDA2: grouped, with an expert bias) | "softmax" (LLaDA-MoE)
    n_group: int = 1  # experts in this many contiguous groups, of which...
    topk_group: int = 1  # ...the best this many are eligible
    renormalize: bool = True  # the chosen experts' weights sum to 1 (before scale)
    activation: str = "silu"  # the experts' gate: silu (SwiGLU) | gelu_tanh (Gemma's GeGLU)
    scale: float = 1.0  # routed_scaling_factor
    expert_bias: bool = False  # a per-expert bias added to the scores for the choice only
    first_dense_layers: int = 0  # layers [0, this) have a dense SwiGLU MLP instead

    def __post_init__(self) -> None:
        if self.score not in ("sigmoid", "softmax"):
            raise CheckpointError(f"config.json: unknown router score {self.score!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise CheckpointError(f"config.json: unknown expert activation {self.activation!r}")
        if not (0 < self.top_k <= self.num_experts and self.intermediate_size > 0
                and self.shared_intermediate_size >= 0 and self.first_dense_layers >= 0):
            raise CheckpointError(
                f"config.json: {self.top_k} experts per token of {self.num_experts}, expert "
                f"width {self.intermediate_size}: not a valid mixture of experts")
        if (self.n_group < 1 or self.num_experts % self.n_group
                or not 1 <= self.topk_group <= self.n_group
                or self.top_k > self.topk_group * (self.num_experts // self.n_group)):
            raise CheckpointError(
                f"config.json: {self.num_experts} experts in n_group {self.n_group} groups with "
                f"topk_group {self.topk_group} cannot supply {self.top_k} experts per token")
        if self.score == "softmax" and (self.expert_bias or self.n_group != 1):
            raise CheckpointError("config.json: a softmax router has no expert bias or groups")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense_layers


@dataclass(frozen=True)
class GemmaLayout:
    """What a Gemma-4 decoder stack (DiffusionGemma) adds to ``ModelConfig``: sliding-window
    and full-attention layers with shapes of their own, proportional RoPE on the full layers,
    the parallel dense MLP beside the experts, soft-capped logits, and the uniform-state
    canvas. ``ModelConfig``'s head_dim, num_kv_heads and rope_theta are the sliding layers'."""

    sliding: tuple[bool, ...]  # per layer: a sliding-window layer (else full attention)
    sliding_window: int  # a sliding layer's query sees this many positions, itself included
    full_head_dim: int
    full_kv_heads: int  # a full layer has no v_proj: its V is the normed K projection
    full_rope_theta: float
    full_rope_fraction: float  # proportional RoPE: the share of a full head's angles that turn
    logit_softcap: float  # logits = cap * tanh(logits / cap), in fp32
    canvas_length: int  # positions of one uniform-state canvas (a block)
    pad_token_id: int

    def __post_init__(self) -> None:
        if not self.sliding or self.sliding[-1]:
            raise CheckpointError("config.json: the last Gemma layer must be full attention")
        if not (self.sliding_window > 0 and self.full_head_dim > 0 and self.full_kv_heads > 0
                and self.canvas_length > 0 and self.logit_softcap > 0
                and 0 < self.full_rope_fraction <= 1):
            raise CheckpointError(
                f"config.json: sliding window {self.sliding_window}, full head_dim "
                f"{self.full_head_dim}, full KV heads {self.full_kv_heads}, canvas "
                f"{self.canvas_length}, softcap {self.logit_softcap} and partial_rotary_factor "
                f"{self.full_rope_fraction} must all be positive (the factor at most 1)")


# The FP8 weight layouts Sangam runs (docs/design.md §6.1): 128 x 128 blocks, one scale per
# output channel, or one per tensor; and how the activations meet them (FP8_ACTIVATIONS in
# kernels/reference.py, tested equal).
FP8_WEIGHTS = ("block", "channel", "tensor")
FP8_ACTIVATIONS = ("none", "dynamic", "static")
FP8_METHODS = ("fp8", "compressed-tensors", "online")
FP8_SCALE_BYTES = 4  # an FP8 KV cache's fp32 scale of each token's head


def fp8_scale_rows(page_size: int, head_dim: int) -> int:
    """Rows of D bytes an FP8 KV page adds after its ``page_size`` token rows to hold their
    scales (one fp32 per token and head): the values' rows stay 16-byte aligned."""
    return -(-page_size * FP8_SCALE_BYTES // head_dim)


@dataclass(frozen=True)
class Fp8Format:
    """How a model's FP8 linear layers are stored and run: ``method`` names the checkpoint
    format (``fp8``: DeepSeek-V3's block-wise ``weight_scale_inv``; ``compressed-tensors``:
    ``weight_scale`` and a static ``input_scale``; ``online``: quantized at load by
    ``--quantization fp8``), ``weights`` the scales' granularity and ``activations`` how the
    inputs are quantized. Which layers are FP8 is read off the checkpoint's tensors."""

    method: str
    weights: str
    activations: str

    def __post_init__(self) -> None:
        if (self.method not in FP8_METHODS or self.weights not in FP8_WEIGHTS
                or self.activations not in FP8_ACTIVATIONS):
            raise CheckpointError(f"FP8 format {self} is not one Sangam runs")

    @property
    def scale_name(self) -> str:
        """The weight scale's tensor name beside ``weight``."""
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"


# --quantization fp8: per-channel weights quantized at load, activations per token-group.
ONLINE_FP8 = Fp8Format("online", "channel", "dynamic")
ONLINE_QUANTIZATIONS = {"fp8": ONLINE_FP8}  # by --quantization's names (config.QUANTIZATIONS)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of sangam.models.loader.ARCHITECTURES
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
    rotary_dim: int = 0  # RoPE rotates the first this many dims of a head; 0: all (head_dim)
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    # SamplingParams defaults of the model's own generate (LLaDA2: threshold 0.95), as
    # (field, value) pairs; the checkpoint's generation_config.json and the flags override them.
    request_defaults: tuple[tuple[str, Any], ...] = ()
    gemma: GemmaLayout | None = None  # DiffusionGemma's layer layout; None: uniform layers
    quantization: Fp8Format | None = None  # FP8 linear layers; None: weights as stored

    @property
    def block_causal(self) -> bool:
        return self.causal_block_size > 0

    def layer_kv_shape(self, i: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer i (a Gemma full-attention layer has its own)."""
        g = self.gemma
        if g is not None and not g.sliding[i]:
            return g.full_kv_heads, g.full_head_dim
        return self.num_kv_heads, self.head_dim

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The sliding-window layers (DiffusionGemma's; none for other models)."""
        g = self.gemma
        return () if g is None else tuple(i for i, s in enumerate(g.sliding) if s)

    def kv_bytes_per_token(self, dtype_bytes: int, layers: Iterable[int] | None = None) -> int:
        """K and V of one token in ``layers`` (default: every layer)."""
        layers = range(self.num_layers) if layers is None else layers
        return 2 * dtype_bytes * sum(h * d for h, d in map(self.layer_kv_shape, layers))

    def fp8_page_bytes(self, page_size: int, layers: Iterable[int] | None = None) -> int:
        """One FP8 KV page of ``layers`` (default: every layer): a byte a value, plus the
        scale rows (``fp8_scale_rows``)."""
        layers = range(self.num_layers) if layers is None else layers
        return 2 * sum(h * d * (page_size + fp8_scale_rows(page_size, d))
                       for h, d in map(self.layer_kv_shape, layers))

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise CheckpointError(
                    f"config.json: hidden size {self.hidden_size} is not a multiple of "
                    f"{self.num_heads} attention heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"config.json: rotary dims {self.rotary_dim} must be even and "
                                  f"within head_dim {self.head_dim}")
        if self.head_dim < 1 or self.causal_block_size < 0:
            raise CheckpointError(f"config.json: head_dim {self.head_dim} must be positive and "
                                  f"the block size {self.causal_block_size} not negative")
        g = self.gemma
        if g is not None and (len(g.sliding) != self.num_layers
                              or self.num_heads % g.full_kv_heads):
            raise CheckpointError(
                f"config.json: {len(g.sliding)} layer types for {self.num_layers} layers, or "
                f"{self.num_heads} heads not a multiple of {g.full_kv_heads} full-layer KV heads")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: {self.num_heads} attention heads are not a multiple of "
                f"{self.num_kv_heads} key/value heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(
                f"config.json: mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"of {self.vocab_size}")
