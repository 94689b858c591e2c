"""Reading a checkpoint's ``config.json`` into a ``ModelConfig`` (docs/design.md §6): the
architecture from ``architectures[0]``, each architecture's key names and defaults, and the
token ids and block sizes the published configs leave out. Anything Sangam cannot serve as
written is refused with a ``CheckpointError`` that names it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from sangam.models.config import CheckpointError, Fp8Format, GemmaLayout, ModelConfig, MoeConfig


def read_config(path: str | os.PathLike) -> ModelConfig:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} not found: a checkpoint needs a config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {e}") from e
    return parse_config(raw, str(path.resolve()))


def _get(cfg: dict[str, Any], key: str, arch: str, default: Any = ...) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"config.json ({arch}) is missing the key {key!r}")
    return default


def _first(x: Any) -> int:
    return int(x[0]) if isinstance(x, (list, tuple)) else int(x)


def parse_config(cfg: dict[str, Any], source: str | None = None) -> ModelConfig:
    """Normalise a checkpoint's ``config.json`` dict (``source``: the directory it was read
    from), its ``quantization_config`` included; raise CheckpointError naming the problem."""
    quantization = parse_quantization(cfg.get("quantization_config"))
    return dataclasses.replace(_architecture_config(cfg, source), quantization=quantization)


SUPPORTED_QUANTIZATION = ("quant_method 'fp8' (128 x 128 blocks, dynamic activations) and "
                          "'compressed-tensors' FP8 (float-quantized, 8-bit float weights)")


def _refuse_quantization(what: str) -> CheckpointError:
    return CheckpointError(f"config.json: quantization_config {what} is not supported; Sangam "
                           f"loads {SUPPORTED_QUANTIZATION}")


def parse_quantization(q: Any) -> Fp8Format | None:
    """The FP8 format of a ``quantization_config`` (None: none given). Anything else (AWQ,
    GPTQ, int8, bitsandbytes, an FP8 variant not listed in ``SUPPORTED_QUANTIZATION``) is a
    CheckpointError naming it: read as if unquantized, such weights would answer garbage."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _refuse_quantization(f"{q!r} (not an object)")
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse_quantization(f"activation_scheme {q['activation_scheme']!r} (fp8)")
        if list(block or ()) != [128, 128]:
            raise _refuse_quantization(f"weight_block_size {block!r} (fp8)")
        if q.get("fmt", "e4m3") != "e4m3":
            raise _refuse_quantization(f"fmt {q['fmt']!r} (fp8: e4m3)")
        return Fp8Format("fp8", "block", "dynamic")
    if method != "compressed-tensors":
        raise _refuse_quantization(f"with quant_method {method!r}")
    for key in ("kv_cache_scheme", "transform_config", "sparsity_config"):
        if q.get(key):
            raise _refuse_quantization(f"{key} {q[key]!r} (compressed-tensors)")
    if q.get("quantization_status", "compressed") != "compressed":
        raise _refuse_quantization(f"quantization_status {q['quantization_status']!r} "
                                   "(compressed-tensors: compressed)")
    # float-quantized: FP8 values stored as float8; naive-quantized: the library's name for
    # the same storage when activations stay unquantized (its weight-only FP8).
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise _refuse_quantization(f"format {q.get('format')!r} (compressed-tensors: "
                                   "float-quantized)")
    groups = list((q.get("config_groups") or {}).values())
    formats = {_compressed_tensors_group(g) for g in groups}
    if len(formats) != 1:
        raise _refuse_quantization(f"config_groups {q.get('config_groups')!r} (compressed-"
                                   "tensors: one FP8 scheme)")
    return formats.pop()


def _compressed_tensors_group(group: Any) -> Fp8Format:
    """One compressed-tensors config group as an Fp8Format, or the refusal naming it."""
    if not isinstance(group, dict) or group.get("output_activations"):
        raise _refuse_quantization(f"group {group!r} (compressed-tensors)")
    if group.get("targets") != ["Linear"]:
        raise _refuse_quantization(f"targets {group.get('targets')!r} (compressed-tensors: "
                                   "['Linear'])")

    def is_fp8(args: Any) -> bool:
        return (isinstance(args, dict) and args.get("num_bits") == 8
                and args.get("type") == "float" and args.get("symmetric", True))

    w, a = group.get("weights"), group.get("input_activations")
    strategy = w.get("strategy") if isinstance(w, dict) else None
    if (not is_fp8(w) or w.get("dynamic") or strategy not in ("block", "channel", "tensor")
            or (strategy == "block" and list(w.get("block_structure") or ()) != [128, 128])):
        raise _refuse_quantization(f"weights {w!r} (compressed-tensors: FP8 per channel, per "
                                   "tensor or per 128 x 128 block)")
    if a is None:
        activations = "none"
    elif is_fp8(a) and a.get("dynamic") is True and (
            a.get("strategy") == "token"
            or (a.get("strategy") == "group" and a.get("group_size") == 128)):
        # Per token, or per group of 128 features: Sangam quantizes dynamic activations per
        # token and group of 128 always (a finer scale than per token; the same kernel).
        activations = "dynamic"
    elif is_fp8(a) and a.get("dynamic") is False and a.get("strategy") == "tensor":
        activations = "static"
    else:
        raise _refuse_quantization(f"input_activations {a!r} (compressed-tensors: FP8 dynamic "
                                   "per token or group of 128, or static per tensor)")
    return Fp8Format("compressed-tensors", strategy, activations)


def _architecture_config(cfg: dict[str, Any], source: str | None) -> ModelConfig:
    """``parse_config`` without the quantization: the architecture's own keys."""
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
    if arch == DIFFUSION_GEMMA_ARCHITECTURE:
        return _diffusion_gemma_config(cfg, arch)
    raise CheckpointError(
        f"config.json: unknown architecture {arch!r}; Sangam serves 'LLaDAModelLM', "
        "'DreamModel', 'SDARForCausalLM', 'LLaDA2MoeModelLM', 'LLaDAMoEModelLM' and "
        f"{DIFFUSION_GEMMA_ARCHITECTURE!r}")


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


DIFFUSION_GEMMA_ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")  # transformers' names of tanh-GELU
GEMMA_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what per_layer_config may set


def _diffusion_gemma_config(cfg: dict[str, Any], arch: str) -> ModelConfig:
    """DiffusionGemma (transformers' ``models/diffusion_gemma``): the text model of
    ``text_config`` — Gemma-4 layers, sliding-window ones (plain RoPE) and full-attention ones
    with their own head_dim and KV heads (``per_layer_config``, or ``global_head_dim`` /
    ``num_global_key_value_heads`` as transformers reads them), K = V and proportional RoPE;
    a dense GeGLU MLP beside softmax-routed GeGLU experts in every layer; tied embeddings;
    logits soft-capped. ``vision_config`` is read by no one: the vision tower is not loaded
    (requests with images are refused). What transformers' code would run differently is
    refused: a bidirectional encoder (``use_bidirectional_attention: "all"``), untied weights,
    biases, another activation, other RoPE types."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json ({arch}) has no 'text_config' object")
    if cfg.get("tie_word_embeddings") is False or text.get("tie_word_embeddings") is False:
        raise CheckpointError(f"config.json ({arch}): tie_word_embeddings false (an encoder, a "
                              "decoder and an LM head of their own) is not supported")

    def g(k, d=...):
        return _get(text, k, f"{arch} text_config", d)

    if text.get("use_bidirectional_attention") == "all":
        raise CheckpointError(f"config.json ({arch}): use_bidirectional_attention 'all' (a "
                              "bidirectional encoder) is not supported: Sangam caches a causal "
                              "encoder's K/V")
    if text.get("attention_bias"):
        raise CheckpointError(f"config.json ({arch}): attention_bias is not supported")
    if g("hidden_activation", "gelu_pytorch_tanh") not in GEMMA_ACTIVATIONS:
        raise CheckpointError(f"config.json ({arch}): hidden_activation "
                              f"{text['hidden_activation']!r} is not supported (tanh-GELU)")
    if g("final_logit_softcapping", 30.0) is None:
        raise CheckpointError(f"config.json ({arch}): final_logit_softcapping must be set")
    layers = int(g("num_hidden_layers"))
    types = list(g("layer_types", ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                   for i in range(layers)]))
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(f"config.json ({arch}): layer_types {types} must name "
                              f"'sliding_attention' or 'full_attention' for each of {layers} "
                              "layers")
    types[-1] = "full_attention"  # as transformers forces it
    head_dim, kv_heads = int(g("head_dim", 256)), int(g("num_key_value_heads"))
    full = {"head_dim": int(g("global_head_dim", 512)),
            "num_key_value_heads": int(g("num_global_key_value_heads", kv_heads))}
    per_layer = text.get("per_layer_config")
    if per_layer:  # as written by transformers: {layer index: overrides}, full layers only
        given = {int(i): v for i, v in per_layer.items()}
        fulls = [i for i, t in enumerate(types) if t == "full_attention"]
        bad = [i for i, v in given.items() if i not in fulls or set(v) - set(GEMMA_LAYER_KEYS)]
        shapes = {tuple(given.get(i, {}).get(k, {"head_dim": head_dim,
                                                  "num_key_value_heads": kv_heads}[k])
                        for k in GEMMA_LAYER_KEYS) for i in fulls}
        if bad or len(shapes) != 1:
            raise CheckpointError(
                f"config.json ({arch}): per_layer_config {per_layer} must give every full-"
                f"attention layer the same {GEMMA_LAYER_KEYS} and nothing else")
        full = dict(zip(GEMMA_LAYER_KEYS, shapes.pop()))
    rope = g("rope_parameters", {})
    slide_rope = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 1e4}
    full_rope = rope.get("full_attention") or {"rope_type": "proportional",
                                               "partial_rotary_factor": 0.25,
                                               "rope_theta": 1e6}
    if (slide_rope.get("rope_type", "default") != "default"
            or slide_rope.get("partial_rotary_factor", 1.0) != 1.0
            or full_rope.get("rope_type") != "proportional" or full_rope.get("factor", 1.0) != 1.0):
        raise CheckpointError(f"config.json ({arch}): rope_parameters {rope} are not supported "
                              "(sliding layers: default RoPE; full layers: proportional, "
                              "factor 1)")
    hidden, experts = int(g("hidden_size")), int(g("num_experts"))
    pad = int(g("pad_token_id", 0))
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=int(g("num_attention_heads")),
        num_kv_heads=kv_heads,
        intermediate_size=int(g("intermediate_size")),
        vocab_size=int(g("vocab_size")),
        mask_token_id=pad,  # uniform-state diffusion has no mask token; the pad id stands in
        eos_token_id=_first(g("eos_token_id", 1)),
        rope_theta=float(slide_rope.get("rope_theta", 1e4)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
        max_position=int(g("max_position_embeddings", 131072)),
        qkv_bias=False,
        shift_logits=False,
        head_dim=head_dim,
        qk_norm=True,
        tie_word_embeddings=True,
        moe=MoeConfig(num_experts=experts, top_k=int(g("top_k_experts")),
                      intermediate_size=int(g("moe_intermediate_size")),
                      shared_intermediate_size=0, score="softmax", renormalize=True,
                      activation="gelu_tanh"),
        gemma=GemmaLayout(
            sliding=tuple(t == "sliding_attention" for t in types),
            sliding_window=int(g("sliding_window", 512)),
            full_head_dim=int(full["head_dim"]),
            full_kv_heads=int(full["num_key_value_heads"]),
            full_rope_theta=float(full_rope.get("rope_theta", 1e6)),
            full_rope_fraction=float(full_rope.get("partial_rotary_factor", 1.0)),
            logit_softcap=float(g("final_logit_softcapping", 30.0)),
            canvas_length=int(_get(cfg, "canvas_length", arch, 256)),
            pad_token_id=pad),
    )
