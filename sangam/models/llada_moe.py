"""LLaDA-MoE (``LLaDAMoEModelLM``: inclusionAI's LLaDA-MoE-7B-A1B-Base / -Instruct): tensor
names as in the public checkpoints (docs/design.md §6).

A bidirectional masked-diffusion model like LLaDA-8B (no block-causal mask, logits not
shifted) on OLMoE's module tree: separate q/k/v/o projections, per-head q/k RMSNorms (over
head_dim, before RoPE; not OLMoE's norm over the whole projection width), full rotate-half
RoPE, and mixture-of-experts MLPs (sangam/models/moe.py): a softmax router over 64 experts in
fp32, the top 8 kept with their probabilities as they are (not renormalised, not scaled).
Layers whose ``moe_layer_freq`` entry is 0 have a dense SwiGLU MLP instead (none in the
released models), and a shared expert, if the config gives it a width (none in the released
models), sits beside the routed ones on the layer (``model.layers.{i}.shared_expert``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from sangam.models.config import ModelConfig
from sangam.models.dream import DreamModel
from sangam.models.kernel_table import KernelTable
from sangam.models.moe import Expert, SparseMoe
from sangam.models.transformer import TORCH, RMSNorm


class LLaDAMoeAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        bias = cfg.qkv_bias  # upstream's attention_bias: all four projections
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=bias)
        if cfg.qk_norm:  # per head, over head_dim
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)


class RoutedPlusShared:
    """A MoE layer's MLP when it has a shared expert: the routed experts plus the shared one,
    both on the same normed input."""

    def __init__(self, routed: SparseMoe, shared: Expert):
        self.routed, self.shared = routed, shared

    def __call__(self, x: torch.Tensor, kernels: KernelTable = TORCH) -> torch.Tensor:
        return self.routed(x, kernels) + self.shared(x)


class LLaDAMoeLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LLaDAMoeAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe
        if moe is not None and moe.is_moe_layer(i):
            # The shared expert is the layer's, not the routed block's (SparseMoe would name
            # it mlp.shared_experts): the block is built without one.
            self.mlp = SparseMoe(cfg.hidden_size,
                                 dataclasses.replace(moe, shared_intermediate_size=0))
            if moe.shared_intermediate_size:
                self.shared_expert = Expert(cfg.hidden_size, moe.shared_intermediate_size)
        else:
            self.mlp = Expert(cfg.hidden_size, cfg.intermediate_size)


class LLaDAMoeModel(DreamModel):
    """Qwen's top-level tree (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``lm_head``), shared with Dream; its own layers."""

    def make_layer(self, cfg: ModelConfig, i: int) -> nn.Module:
        return LLaDAMoeLayer(cfg, i)

    def layer_mlp(self, layer: nn.Module):
        if hasattr(layer, "shared_expert"):
            return RoutedPlusShared(layer.mlp, layer.shared_expert)
        return layer.mlp
