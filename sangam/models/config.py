"""Architecture-neutral view of a checkpoint's ``config.json`` (docs/design.md §6)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any


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
    scale: float = 1.0  # routed_scaling_factor
    expert_bias: bool = False  # a per-expert bias added to the scores for the choice only
    first_dense_layers: int = 0  # layers [0, this) have a dense SwiGLU MLP instead

    def __post_init__(self) -> None:
        if self.score not in ("sigmoid", "softmax"):
            raise CheckpointError(f"config.json: unknown router score {self.score!r}")
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
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise CheckpointError(f"config.json: rotary dims {self.rotary_dim} must be even and "
                                  f"within head_dim {self.head_dim}")
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
    if arch == "LLaDA2MoeModelLM":
        return _llada2_config(cfg, arch, source)
    if arch in LLADA_MOE_ARCHITECTURES:
        return _llada_moe_config(cfg, arch)
    raise CheckpointError(
        f"config.json: unknown architecture {arch!r}; Sangam serves 'LLaDAModelLM', "
        "'DreamModel', 'SDARForCausalLM', 'LLaDA2MoeModelLM' and 'LLaDAMoEModelLM'")


LLADA2_MASK_TOKEN_ID = 156895  # <|mask|>
LLADA2_EOS_TOKEN_ID = 156892  # <|endoftext|>
LLADA2_BLOCK_SIZE = 32  # the block its generate() decodes and its training used
# Request defaults of the upstream generate: LLaDA2.0's threshold; LLaDA2.1's quality mode
# (the S-mode, threshold 0.5 and edit_threshold 0.0, is the faster one, per request).
LLADA2_DEFAULTS = (("threshold", 0.95),)
LLADA21_DEFAULTS = (("threshold", 0.7), ("edit_threshold", 0.5), ("max_post_steps", 16))


def _llada2_config(cfg: dict[str, Any], arch: str, source: str | None) -> ModelConfig:
    """LLaDA2.x (inclusionAI's Bailing-MoE-V2 tree): block-causal over blocks of 32, fused QKV,
    q/k norms, RoPE on part of each head, a dense first layer, then grouped sigmoid routing
    with an expert bias and a shared expert. ``norm_topk_prob``, ``score_function``,
    ``router_dtype`` and ``rotary_dim`` appear in the configs but the upstream code never reads
    them: it always renormalises, scores by sigmoid in fp32 and rotates by
    ``partial_rotary_factor``; so does this. LLaDA2.1 shares 2.0's config.json; its name
    (``_name_or_path``, or the directory) turns token editing on by default."""
    def g(k, d=...):
        return _get(cfg, k, arch, d)

    qwen = _qwen_fields(cfg, arch, mask_token_id=LLADA2_MASK_TOKEN_ID,
                        eos_token_id=LLADA2_EOS_TOKEN_ID)
    head_dim = int(g("head_dim", qwen["hidden_size"] // qwen["num_heads"]))
    experts = int(g("num_experts"))
    width = int(g("moe_intermediate_size"))
    return ModelConfig(
        **{**qwen, "rope_theta": float(g("rope_theta", 600000.0))},
        qkv_bias=bool(cfg.get("use_qkv_bias", False)),
        shift_logits=False,
        head_dim=head_dim,
        qk_norm=bool(g("use_qk_norm", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        causal_block_size=int(g("block_size", LLADA2_BLOCK_SIZE)),
        rotary_dim=int(head_dim * float(g("partial_rotary_factor", 1.0))),
        moe=MoeConfig(
            num_experts=experts, top_k=int(g("num_experts_per_tok")),
            intermediate_size=width,
            shared_intermediate_size=int(g("num_shared_experts", 0)) * width,
            score="sigmoid", n_group=int(g("n_group", 1)), topk_group=int(g("topk_group", 1)),
            renormalize=True, scale=float(g("routed_scaling_factor", 1.0)),
            expert_bias=bool(g("moe_router_enable_expert_bias", True)),
            first_dense_layers=int(g("first_k_dense_replace", 0))),
        request_defaults=(LLADA21_DEFAULTS if any(
            re.search(r"LLaDA2\.1", str(name or ""), re.IGNORECASE)
            for name in (cfg.get("_name_or_path"), source)) else LLADA2_DEFAULTS),
    )


# LLaDA-MoE's remote code names its class LLaDAMoEModelLM (what its config.json lists);
# llama.cpp's converter also accepts LLaDAMoEModel.
LLADA_MOE_ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")
LLADA_MOE_MASK_TOKEN_ID = 156895  # <|mask|>, LLaDA2's tokenizer and vocabulary
LLADA_MOE_EOS_TOKEN_ID = 156892  # <|endoftext|>


def _llada_moe_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """LLaDA-MoE-7B-A1B (inclusionAI's modeling_lladamoe.py, OLMoE's tree): bidirectional,
    separate q/k/v/o, per-head q/k norms (``qk_layernorm``), full RoPE unless
    ``partial_rotary_factor`` says otherwise, head_dim = hidden / heads (no head_dim key), and
    softmax routing in fp32 whose top-k probabilities weight the experts as they are: the
    upstream block hard-codes ``norm_topk_prob = False`` and never reads
    ``routed_scaling_factor``, ``moe_router_score_function`` or the router group keys; neither
    does this. Layers with ``moe_layer_freq`` 0 are dense (``dense_intermediate_size``); a
    positive ``shared_expert_intermediate_size`` adds a shared expert to every MoE layer.
    Upstream features the released checkpoints leave off are refused, not approximated: an
    expert bias (upstream adds it to the softmax probabilities, weights included), q/k/v
    clipping and RoPE scaling."""
    def g(k, d=...):
        return _get(cfg, k, arch, d)

    for key in ("moe_router_enable_expert_bias", "clip_qkv", "rope_scaling"):
        if cfg.get(key):
            raise CheckpointError(f"config.json ({arch}): {key} = {cfg[key]!r} is not supported")
    if g("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json ({arch}): hidden_act {cfg['hidden_act']!r} is not "
                              "supported (SwiGLU experts: silu)")
    n_heads = int(g("num_attention_heads"))
    hidden = int(g("hidden_size"))
    layers = int(g("num_hidden_layers"))
    experts, top_k = int(g("num_experts")), int(g("num_experts_per_tok"))
    width = int(g("expert_intermediate_size"))
    freq = [int(f) for f in g("moe_layer_freq", [1] * layers)][:layers]
    dense = next((i for i, f in enumerate(freq) if f != 0), len(freq))
    if len(freq) < layers or any(f == 0 for f in freq[dense:]):
        raise CheckpointError(
            f"config.json ({arch}): moe_layer_freq {freq} must give each of the {layers} layers "
            "a flag, dense layers (0) only before the mixture-of-experts ones")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=n_heads,
        num_kv_heads=int(g("num_key_value_heads", n_heads)),
        # The dense layers' width; with none (the released models) it is unused, and equals
        # top_k x the expert width: the MLP FLOPs per token (what the cost model reads).
        intermediate_size=int(g("dense_intermediate_size", top_k * width)),
        vocab_size=int(g("vocab_size")),
        mask_token_id=int(g("mask_token_id", LLADA_MOE_MASK_TOKEN_ID)),
        eos_token_id=_first(g("eos_token_id", LLADA_MOE_EOS_TOKEN_ID)),
        rope_theta=float(g("rope_theta", 50000.0)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-5)),
        max_position=int(g("max_position_embeddings", 8192)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        shift_logits=False,
        qk_norm=bool(g("qk_layernorm", True)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rotary_dim=int(hidden // n_heads * float(g("partial_rotary_factor", 1.0))),
        moe=MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=width,
                      shared_intermediate_size=max(shared, 0), score="softmax",
                      renormalize=False, scale=1.0, first_dense_layers=dense),
    )


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


@dataclass(frozen=True)
class ShardLayout:
    """Which slice of a model one rank of a tensor-parallel group holds (Megatron sharding:
    docs/design.md §4.10): attention heads split across the ``size`` ranks (KV heads split, or
    one per rank, replicated, when there are fewer KV heads than ranks), MLP widths split, the
    LM head's vocabulary split, the embedding and norms whole. With ``expert_parallel`` a
    mixture of experts' experts are split instead of each expert's width."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if not (self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size}")

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError, naming the flag, when ``cfg`` cannot be split ``size`` ways."""
        moe = cfg.moe
        dense_layers = cfg.num_layers if moe is None else moe.first_dense_layers
        self.check_split(cfg.architecture, cfg.num_heads, cfg.num_kv_heads,
                         cfg.intermediate_size if dense_layers else 0,
                         *((moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size)
                           if moe is not None else ()))

    def check_split(self, name: str, heads: int, kv_heads: int, dense_width: int,
                    experts: int = 0, expert_width: int = 0, shared_width: int = 0) -> None:
        """:meth:`check` over a model's counts (the simulator's geometries have no config):
        ``dense_width`` 0 without dense MLPs, ``experts`` 0 without experts."""
        if self.expert_parallel and not experts:
            raise ValueError(f"--enable-expert-parallel: {name} is not a mixture-of-experts "
                             "model")
        n = self.size
        if n == 1:
            return
        problems = []
        if heads % n:
            problems.append(f"its {heads} attention heads")
        if kv_heads % n and n % kv_heads:
            problems.append(f"its {kv_heads} KV heads (neither divides the other)")
        if dense_width % n:
            problems.append(f"its MLP width {dense_width}")
        if experts:
            if self.expert_parallel and experts % n:
                problems.append(f"its {experts} experts (--enable-expert-parallel)")
            if not self.expert_parallel and expert_width % n:
                problems.append(f"its expert width {expert_width}")
            if shared_width % n:
                problems.append(f"its shared experts' width {shared_width}")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n} cannot split {name}: "
                             f"{'; '.join(problems)} do not split over {n} ranks")

    def kv_heads(self, num_kv_heads: int) -> int:
        """How many KV heads a rank holds: its share, or one (replicated) when there are
        fewer KV heads than ranks."""
        return max(1, num_kv_heads // self.size)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of ``n`` things split evenly (``check`` made sure)."""
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def heads(self, cfg: ModelConfig) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's query heads and KV heads, as [start, end). With fewer KV heads than
        ranks each rank holds the one KV head its query heads read (vLLM's rule)."""
        q = self.split(cfg.num_heads)
        per_rank = self.kv_heads(cfg.num_kv_heads)
        # Below one KV head per rank, ranks r*Hkv//N share a head; else each its own share.
        first = (self.rank * cfg.num_kv_heads // self.size if cfg.num_kv_heads < self.size
                 else self.rank * per_rank)
        return q, (first, first + per_rank)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts: what sizes its KV pages and activations."""
        if self.size == 1:
            return cfg
        (q0, q1), (k0, k1) = self.heads(cfg)
        return dataclasses.replace(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the LM head: chunks of ceil(V / size), the last one shorter."""
        k = -(-vocab_size // self.size)
        return min(vocab_size, self.rank * k), min(vocab_size, (self.rank + 1) * k)
