"""Tiny random checkpoints in the real LLaDA / Dream / SDAR / LLaDA2 / LLaDA-MoE layouts, for
tests and for trying Sangam without weights, and config.json files of the real models' shapes
for ``--load-format dummy``.

    python -m sangam.testing DIR                      # a tiny LLaDA checkpoint with weights
    python -m sangam.testing DIR --shape llada --config-only   # LLaDA-8B's config.json only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from sangam.models.checkpoint import parse_config
from sangam.models.loader import ARCHITECTURES, save_checkpoint
from sangam.models.registry import LAYOUTS, MODEL_SHAPES


def tiny_config(arch: str = "llada", vocab_size: int = 160, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 4, num_kv_heads: int | None = None,
                intermediate_size: int = 128, max_position: int = 1024,
                tie_word_embeddings: bool = False, head_dim: int | None = None,
                moe: dict | None = None, block_size: int | None = None) -> dict:
    """A config.json dict with the real key names, mask token = last id, EOS = id 1
    (``tie_word_embeddings``: SDAR's smaller models tie their LM head to the embedding;
    ``moe``: the mixture-of-experts keys of a MoE layout, over its tiny defaults;
    ``block_size``: a block-causal layout's, written as SDAR's key, which Sangam reads for
    LLaDA2 too)."""
    if arch == "llada":
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "d_model": hidden_size, "n_layers": num_layers, "n_heads": num_heads,
            "n_kv_heads": num_kv_heads or num_heads, "mlp_hidden_size": intermediate_size,
            "vocab_size": vocab_size, "embedding_size": vocab_size,
            "mask_token_id": vocab_size - 1, "eos_token_id": 1, "pad_token_id": 1,
            "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_sequence_length": max_position,
            "include_bias": False, "weight_tying": False,
        }
    if arch == "dream":
        return {
            "architectures": ["DreamModel"], "model_type": "Dream",
            "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads or num_heads,
            "intermediate_size": intermediate_size, "vocab_size": vocab_size,
            "mask_token_id": vocab_size - 1, "eos_token_id": 1, "pad_token_id": 1,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": max_position,
            "tie_word_embeddings": False,
        }
    if arch == "sdar":  # Qwen3 key names; head_dim given (not hidden / heads), as SDAR's is
        return {
            "architectures": ["SDARForCausalLM"], "model_type": "sdar",
            "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads or num_heads,
            "head_dim": head_dim or 2 * hidden_size // num_heads,
            "intermediate_size": intermediate_size,
            "vocab_size": vocab_size, "mask_token_id": vocab_size - 1, "eos_token_id": 1,
            "pad_token_id": 1, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
            "max_position_embeddings": max_position, "tie_word_embeddings": tie_word_embeddings,
            "attention_bias": False, "block_size": block_size or 4,
        }
    if arch == "llada2":  # LLaDA2.x's keys (Bailing-MoE-V2): 8 experts in 4 groups, top 2
        return {
            "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
            "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads or num_heads,
            "head_dim": head_dim or hidden_size // num_heads,
            "intermediate_size": intermediate_size, "vocab_size": vocab_size,
            "mask_token_id": vocab_size - 1, "eos_token_id": 1, "pad_token_id": 1,
            "rope_theta": 600000.0, "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.5,
            "max_position_embeddings": max_position, "tie_word_embeddings": tie_word_embeddings,
            "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
            "first_k_dense_replace": 1, "num_shared_experts": 1,
            "routed_scaling_factor": 2.5, "score_function": "sigmoid", "norm_topk_prob": True,
            "moe_router_enable_expert_bias": True,
            **({"block_size": block_size} if block_size else {}),
            **{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "n_group": 4, "topk_group": 2, **(moe or {})},
        }
    if arch == "llada_moe":  # LLaDA-MoE's keys (OLMoE-like): 8 experts, top 2, all layers MoE
        return {
            "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
            "hidden_size": hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads or num_heads,
            "dense_intermediate_size": intermediate_size, "vocab_size": vocab_size,
            "mask_token_id": vocab_size - 1, "eos_token_id": 1, "pad_token_id": 1,
            "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "partial_rotary_factor": 1,
            "rope_scaling": None, "max_position_embeddings": max_position,
            "tie_word_embeddings": tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "clip_qkv": None, "qk_layernorm": True,
            "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
            "norm_topk_prob": False, "routed_scaling_factor": 1,
            **{"num_experts": 8, "num_experts_per_tok": 2, "expert_intermediate_size": 32,
               "shared_expert_intermediate_size": None, "moe_layer_freq": [1] * num_layers,
               **(moe or {})},
        }
    raise ValueError(f"unknown tiny architecture {arch!r}: use one of {LAYOUTS}")


def real_shape_config(key: str, max_position: int = 4096) -> dict:
    """config.json of a known model's shape (``sangam.models.registry.MODEL_SHAPES``: llada =
    LLaDA-8B, dream = Dream-7B, sdar = SDAR-8B, ...) with this module's token conventions; for
    random weights, not for real ones."""
    shape = MODEL_SHAPES[key]
    extra = {}
    if shape.layout in ("sdar", "llada2"):  # the layouts that name head_dim and the tied head
        extra = {"head_dim": shape.head_dim, "tie_word_embeddings": shape.tie_word_embeddings}
    if shape.moe is not None:
        extra["moe"] = shape.moe.config_keys(shape.layout, shape.num_layers)
    return tiny_config(shape.layout, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       num_layers=shape.num_layers, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads,
                       intermediate_size=shape.intermediate_size, max_position=max_position,
                       **extra)


def make_tiny_checkpoint(path: str | os.PathLike, arch: str = "llada", seed: int = 0,
                         logit_scale: float = 6.0, max_shard_bytes: int | None = None,
                         **config_overrides) -> str:
    """Write a random checkpoint; ``logit_scale`` sets the logits' spread, so that some positions
    are confident and parallel unmasking has something to do. Returns the path."""
    raw = tiny_config(arch, **config_overrides)
    cfg = parse_config(raw)
    gen = torch.Generator().manual_seed(seed)
    model = ARCHITECTURES[cfg.architecture](cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".ln_f." in name or name.endswith("_norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "wte" in name or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                std = (logit_scale if p.shape[0] == cfg.vocab_size else 1.0) / p.shape[1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
    save_checkpoint(model, raw, path, max_shard_bytes=max_shard_bytes)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sangam.testing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="directory to write")
    p.add_argument("--arch", choices=LAYOUTS, default="llada",
                   help="tiny checkpoint's architecture")
    p.add_argument("--shape", choices=list(MODEL_SHAPES), default=None,
                   help="a real model's shape instead of the tiny one (implies --config-only)")
    p.add_argument("--config-only", action="store_true",
                   help="write config.json only: load it with --load-format dummy")
    args = p.parse_args(argv)
    if args.shape is None and not args.config_only:
        print(make_tiny_checkpoint(args.path, args.arch))
        return 0
    raw = real_shape_config(args.shape) if args.shape else tiny_config(args.arch)
    path = Path(args.path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
