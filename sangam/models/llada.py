"""LLaDA (``LLaDAModelLM``): tensor names as in the public checkpoints (docs/design.md §6)."""

from __future__ import annotations

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.transformer import DiffusionLM, LayerParts, RMSNorm, SplitQKV, SwiGLU


class LLaDABlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd, kvd = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, kvd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, kvd, bias=cfg.qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_proj = nn.Linear(d, cfg.intermediate_size, bias=False)  # SiLU gate
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.ff_out = nn.Linear(cfg.intermediate_size, d, bias=False)  # down projection


class LLaDAModel(DiffusionLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        transformer = nn.Module()
        transformer.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        transformer.blocks = nn.ModuleList(LLaDABlock(cfg) for _ in range(cfg.num_layers))
        transformer.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        transformer.ff_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.model = nn.Module()
        self.model.transformer = transformer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.wte(ids)

    def layer_parts(self, i: int) -> LayerParts:
        b = self.model.transformer.blocks[i]
        return LayerParts(b.attn_norm, SplitQKV(b.q_proj, b.k_proj, b.v_proj), None, b.attn_out,
                          b.ff_norm, SwiGLU(b.ff_proj, b.up_proj, b.ff_out))

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.ln_f(h)

    def output_head(self) -> nn.Linear:
        return self.model.transformer.ff_out
