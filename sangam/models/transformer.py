"""The transformer every architecture shares: pre-norm blocks, RMSNorm, RoPE, SwiGLU.

LLaDA, Dream and SDAR differ only in tensor names, q/k/v biases, SDAR's q/k norms and explicit
head_dim, Dream's one-position logit shift and SDAR's block-causal mask (an attention matter),
so each subclass mirrors its Hugging Face module tree (state_dict keys are the real tensor
names) and hands its layers to the shared code here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sangam.models.attention import AttentionBackend, AttentionMetadata, PagedKV
from sangam.models.config import ModelConfig


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms, RoPE and softmax run in at least fp32, in fp64 for fp64 models."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding:
    """Rotate-half (NeoX / HF Llama) RoPE over a cos/sin table of every position the model
    allows, built once per dtype and device: lookups never read positions back to the host (no
    device sync, so CUDA graphs can capture them). Callers keep positions below
    ``max_positions``; the engine rejects longer requests at submission."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        self.head_dim = head_dim
        self.theta = theta
        self.max_positions = max_positions
        self._table: torch.Tensor | None = None  # [2, max_positions, head_dim] cos | sin

    def table(self, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables ``[max_positions, head_dim]`` (what the fused RoPE store
        kernel reads)."""
        t = self._table
        if t is None or t.dtype != dtype or t.device != device:
            inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64)
                                        / self.head_dim))
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            t = torch.stack([emb.cos(), emb.sin()]).to(dtype=dtype, device=device)
            self._table = t
        return t[0], t[1]

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[..., 1, head_dim]`` for positions ``[...]``, ready to broadcast over
        heads in :meth:`apply`."""
        cos, sin = self.table(dtype, positions.device)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ``[..., H, D]`` by :meth:`cos_sin` of its positions, in their dtype."""
        xf = x.to(cos.dtype)
        half = self.head_dim // 2
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DiffusionLM(nn.Module):
    """Base of LLaDA and Dream. Subclasses build the module tree and implement the accessors."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.attention_backend: AttentionBackend | None = None

    # Accessors each architecture provides.
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layer_parts(self, i: int) -> tuple[nn.Module, ...]:
        """(attn_norm, q, k, v, o, mlp_norm, gate, up, down) of layer i."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output_head(self) -> nn.Module:
        """The LM head: a Linear, or an Embedding when tied (its weight is the same
        ``[vocab, hidden]`` matrix)."""
        raise NotImplementedError

    def qk_norms(self, i: int) -> tuple[nn.Module, nn.Module] | None:
        """(q_norm, k_norm) of layer i, RMSNorms over head_dim applied before RoPE; None for
        architectures without them."""
        return None

    # Shared computation.
    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        cfg = self.config
        lead = h.shape[:-1]
        cos, sin = self.rope.cos_sin(positions, compute_dtype(h.dtype))  # once, for all layers
        for i in range(cfg.num_layers):
            attn_norm, q_p, k_p, v_p, o_p, mlp_norm, gate, up, down = self.layer_parts(i)
            x = attn_norm(h)
            q = q_p(x).view(*lead, cfg.num_heads, cfg.head_dim)
            k = k_p(x).view(*lead, cfg.num_kv_heads, cfg.head_dim)
            norms = self.qk_norms(i)
            if norms is not None:
                q, k = norms[0](q), norms[1](k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            v = v_p(x).view(*lead, cfg.num_kv_heads, cfg.head_dim)
            h = h + o_p(attend(i, q, k, v).reshape(*lead, cfg.num_heads * cfg.head_dim))
            x = mlp_norm(h)
            h = h + down(F.silu(gate(x)) * up(x))
        return self.final_norm(h)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: PagedKV, logits_indices: torch.Tensor) -> torch.Tensor:
        """One packed forward over spans of several requests.

        input_ids/positions ``[N]``; returns logits ``[M, vocab]`` for the hidden rows
        ``logits_indices`` only (the LM head never runs over all N rows).
        """
        return self.logits(self.hidden_states(input_ids, positions, meta, kv), logits_indices)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, kv: PagedKV) -> torch.Tensor:
        """The body of :meth:`forward`: final-norm hidden states ``[N, hidden]``, storing each
        span's K/V on the way. No host syncs (CUDA graphs capture it)."""
        backend = self.attention_backend
        if backend is None:
            raise RuntimeError("no attention backend set on the model")

        def attend(i, q, k, v):
            return backend.forward(q, k, v, kv.k[i], kv.v[i], meta, self.scale)

        return self._layers(self.embed(input_ids), positions, attend)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The LM head on the rows ``logits_indices`` of ``hidden`` only."""
        return F.linear(hidden[logits_indices], self.output_head().weight)

    def forward_dense(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None,
                      block_size: int | None = None) -> torch.Tensor:
        """Plain full-sequence forward, ``[B, T] -> [B, T, vocab]``, with autograd.

        No cache and no paging: the oracle for tests and the forward used for training.
        ``key_mask [B, T]`` (bool) hides the False positions from every query (padding).
        Bidirectional, or for a block-causal model block-causal over blocks of ``block_size``
        positions (default: the model's), counted from position 0.
        """
        cfg = self.config
        group = cfg.num_heads // cfg.num_kv_heads
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        if cfg.block_causal:
            blk = positions // (block_size or cfg.causal_block_size)
            causal = (blk[None, :] <= blk[:, None])[None, None]
            mask = causal if mask is None else mask & causal

        def attend(i, q, k, v):  # [B, T, H, D]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            return out.transpose(1, 2)

        return F.linear(self._layers(self.embed(input_ids), positions, attend),
                        self.output_head().weight)
