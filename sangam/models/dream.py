"""Dream (``DreamModel``): Qwen2 geometry and tensor names (DESIGN.md §6)."""

from __future__ import annotations

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.transformer import DiffusionLM, RMSNorm


class DreamAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, kvd = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=True)
        self.k_proj = nn.Linear(d, kvd, bias=True)
        self.v_proj = nn.Linear(d, kvd, bias=True)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, d, bias=False)


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
        self.model.layers = nn.ModuleList(DreamLayer(cfg) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def layer_parts(self, i: int) -> tuple[nn.Module, ...]:
        layer = self.model.layers[i]
        a, m = layer.self_attn, layer.mlp
        return (layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                layer.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def output_head(self) -> nn.Linear:
        return self.lm_head
