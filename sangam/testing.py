"""Tiny random checkpoints in the real LLaDA / Dream / SDAR / LLaDA2 / LLaDA-MoE layouts, for
tests and for trying Sangam without weights, and config.json files of the real models' shapes
for ``--load-format dummy``.

    python -m sangam.testing DIR                      # a tiny LLaDA checkpoint with weights
    python -m sangam.testing DIR --shape llada --config-only   # LLaDA-8B's config.json only
    python -m sangam.testing DIR --fp8 fp8-block --from sangam/demo/model_long  # as FP8

FP8 copies are written by the ecosystem's own code: transformers' FineGrainedFP8 quantizer
(``fp8-block``, DeepSeek-V3's format) and the compressed-tensors library (``ct-*``: its
FP8_DYNAMIC, FP8 and FP8_BLOCK presets, and FP8_DYNAMIC's weights alone), so the format is
theirs, not Sangam's reading of it.
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


# --fp8: the writer, and for compressed-tensors its preset scheme.
FP8_WRITERS = {"fp8-block": None, "ct-channel": "FP8_DYNAMIC", "ct-static": "FP8",
               "ct-block": "FP8_BLOCK", "ct-weight-only": "FP8_DYNAMIC"}
CHECKPOINT_SIDE_FILES = ("generation_config.json", "special_tokens_map.json", "tokenizer.json",
                         "tokenizer_config.json", "training.json")


def write_fp8_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, scheme: str,
                         calibration_tokens: int = 256) -> str:
    """``src`` (a full-precision checkpoint) rewritten as FP8 by ``scheme`` (FP8_WRITERS) into
    ``dst``, its tokenizer and generation files copied. Every projection but the LM head is
    quantized where the writer can (transformers' skips shapes that are not multiples of its
    128 x 128 blocks); ``ct-static`` calibrates each layer's input scale on random tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    cfg = parse_config(raw)
    model = ARCHITECTURES[cfg.architecture](cfg)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    model.load_state_dict(state, strict=True)
    names = {id(m): n for n, m in model.named_modules()}
    head = names[id(model.output_head())]
    dst.mkdir(parents=True, exist_ok=True)
    for name in CHECKPOINT_SIDE_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    if scheme == "fp8-block":
        out, qcfg = _transformers_fp8(state, head)
    else:
        out, qcfg = _compressed_tensors_fp8(model, FP8_WRITERS[scheme], head,
                                            calibration_tokens,
                                            weight_only=scheme == "ct-weight-only")
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**raw, "quantization_config": qcfg}, indent=2))
    return str(dst)


def _transformers_fp8(state: dict[str, torch.Tensor], head: str) -> tuple[dict, dict]:
    """Every 2-D weight but the head's and the embedding's through transformers'
    ``Fp8Quantize`` (its save path for FineGrainedFP8 models)."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qcfg = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=[head])
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=qcfg))
    out = {}
    for name, t in state.items():
        keep = (t.dim() < 2 or name.startswith(f"{head}.") or "norm" in name
                or name.endswith(("wte.weight", "embed_tokens.weight", "gate.weight")))
        out.update({name: t} if keep else quantize.convert({name: t}))
    return out, json.loads(qcfg.to_json_string())


def _compressed_tensors_fp8(model: torch.nn.Module, preset: str, head: str,
                            calibration_tokens: int, weight_only: bool = False
                            ) -> tuple[dict, dict]:
    """The model's Linear layers but the head quantized by compressed-tensors' ``preset``
    (``weight_only``: its weights, the activations left in the model's dtype):
    weight scales from each channel's, tensor's or block's range (its ``calculate_qparams``),
    static input scales from the largest input each layer saw on random tokens, then the
    library's own compression and config."""
    import tempfile

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    seen: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(
        lambda m, args, n=n: seen.__setitem__(n, max(seen.get(n, 0.0),
                                                     float(args[0].abs().max()))))
        for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    ids = torch.randint(0, model.config.vocab_size, (1, calibration_tokens),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.forward_dense(ids)
    for h in hooks:
        h.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_only:
        scheme = scheme.model_copy(update={"input_activations": None})
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=[head])
    apply_quantization_config(model, config)
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, args = m.weight.detach(), scheme.weights
        if args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "tensor":
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        else:  # 128 x 128 blocks, the last ones cut short where a side is not a multiple
            n, k = w.shape
            rows, cols = range(0, n, 128), range(0, k, 128)
            lo = torch.tensor([[w[i:i + 128, j:j + 128].min() for j in cols] for i in rows])
            hi = torch.tensor([[w[i:i + 128, j:j + 128].max() for j in cols] for i in rows])
        scale, _ = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):  # static: the calibration's amax maps to FP8's max
            # Routed experts never run as Linear modules here: the largest input any layer saw.
            m.input_scale.data.fill_(seen.get(name, max(seen.values())) / 448.0)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out = {k: v.contiguous() for k, v in model.state_dict().items()
           if not k.endswith("zero_point")}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text("{}")
        compressor.update_config(d)
        qcfg = json.loads((Path(d) / "config.json").read_text())["quantization_config"]
    return out, qcfg


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
    p.add_argument("--fp8", choices=list(FP8_WRITERS), default=None,
                   help="write --from's checkpoint as FP8 (needs transformers, or "
                   "compressed-tensors for ct-*)")
    p.add_argument("--from", dest="source", default=None,
                   help="with --fp8: the full-precision checkpoint to quantize")
    args = p.parse_args(argv)
    if args.fp8:
        if not args.source:
            p.error("--fp8 needs --from CHECKPOINT")
        print(write_fp8_checkpoint(args.source, args.path, args.fp8))
        return 0
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
