"""Dream (``DreamModel``): Qwen2 geometry and tensor names (docs/design.md §6).

The module tree is Qwen's, which SDAR (Qwen3) shares with two additions read from the config:
q/k RMSNorms (``qk_norm``) and an LM head tied to the embedding (``tie_word_embeddings``).
"""

from __future__ import annotations

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.transformer import DiffusionLM, LayerParts, RMSNorm, SplitQKV, SwiGLU


class DreamAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, kvd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kvd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kvd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)
        if cfg.qk_norm:  # Qwen3 / SDAR: per-head RMSNorm of q and k before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class DreamMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class DreamLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DreamAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DreamMLP(cfg)


class DreamModel(DiffusionLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_layer(self, cfg: ModelConfig, i: int) -> nn.Module:
        """Layer i (models on the same tree, LLaDA-MoE, build their own)."""
        return DreamLayer(cfg)

    def layer_mlp(self, layer: nn.Module):
        """A layer's MLP as ``LayerParts.mlp``."""
        m = layer.mlp
        return SwiGLU(m.gate_proj, m.up_proj, m.down_proj)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def layer_parts(self, i: int) -> LayerParts:
        layer = self.model.layers[i]
        a = layer.self_attn
        return LayerParts(layer.input_layernorm, SplitQKV(a.q_proj, a.k_proj, a.v_proj),
                          (a.q_norm, a.k_norm) if self.config.qk_norm else None, a.o_proj,
                          layer.post_attention_layernorm, self.layer_mlp(layer))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def output_head(self) -> nn.Module:
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
