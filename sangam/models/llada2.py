"""LLaDA2.x (``LLaDA2MoeModelLM``: LLaDA2.0-mini/-flash, LLaDA2.1-mini): tensor names as in
the public checkpoints (docs/design.md §6).

Block diffusion over blocks of 32 from position 0 (the block-causal mask is the attention
backend's, ``ModelConfig.causal_block_size``, as for SDAR); a fused [Q|K|V] projection with
per-head q/k RMSNorms; RoPE on the first half of each head; a dense SwiGLU first layer
(``first_k_dense_replace``), then mixture-of-experts layers (sangam/models/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.moe import Expert, SparseMoe
from sangam.models.transformer import DiffusionLM, LayerParts, RMSNorm


class FusedQKV:
    """The fused projection as a ``qkv`` callable: one matmul, split into q | k | v (of
    ``heads`` query and ``kv_heads`` KV heads: this rank's, under tensor parallelism)."""

    def __init__(self, proj: nn.Linear, heads: int, kv_heads: int, head_dim: int):
        self.proj = proj
        self.sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.proj(x).split(self.sizes, dim=-1)


class LLaDA2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv, bias=cfg.qkv_bias)
        self.dense = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)


class LLaDA2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = LLaDA2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        self.mlp = (SparseMoe(cfg.hidden_size, moe) if moe is not None and moe.is_moe_layer(i)
                    else Expert(cfg.hidden_size, cfg.intermediate_size))


class LLaDA2Model(DiffusionLM):
    full_precision_tensors = ("gate.expert_bias",)  # fp32 in the checkpoints, as routed

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = nn.Module()
        self.model.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(LLaDA2Layer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(ids)

    def layer_parts(self, i: int) -> LayerParts:
        layer = self.model.layers[i]
        a = layer.attention
        return LayerParts(layer.input_layernorm, FusedQKV(a.query_key_value, *self.local_heads,
                                                         self.config.head_dim),
                          (a.query_layernorm, a.key_layernorm) if self.config.qk_norm else None,
                          a.dense, layer.post_attention_layernorm, layer.mlp)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def output_head(self) -> nn.Module:
        return self.model.word_embeddings if self.config.tie_word_embeddings else self.lm_head
