"""SDAR (``SDARForCausalLM``, JetAstra): Qwen3 geometry and tensor names (DESIGN.md §6).

A block-causal diffusion model: attention is bidirectional within a block and causal across
blocks (the attention backend applies the mask; ``ModelConfig.causal_block_size`` is the
trained block size), logits are not shifted, and q and k pass through per-head RMSNorms before
RoPE. The LM head may be tied to the embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.transformer import DiffusionLM, RMSNorm


class SDARAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)


class SDARMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class SDARLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SDARAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SDARMLP(cfg)


class SDARModel(DiffusionLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(SDARLayer(cfg) for _ in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def layer_parts(self, i: int) -> tuple[nn.Module, ...]:
        layer = self.model.layers[i]
        a, m = layer.self_attn, layer.mlp
        return (layer.input_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                layer.post_attention_layernorm, m.gate_proj, m.up_proj, m.down_proj)

    def qk_norms(self, i: int) -> tuple[nn.Module, nn.Module]:
        a = self.model.layers[i].self_attn
        return a.q_norm, a.k_norm

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def output_head(self) -> nn.Module:
        return self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
