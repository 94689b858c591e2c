"""The transformer every architecture shares: pre-norm blocks, RMSNorm, RoPE, SwiGLU.

LLaDA, Dream, SDAR and LLaDA2 differ in tensor names, q/k/v biases and fusion, q/k norms,
head_dim, partial RoPE, Dream's one-position logit shift, the block-causal mask (an attention
matter) and LLaDA2's mixture-of-experts MLPs; so each subclass mirrors its Hugging Face module
tree (state_dict keys are the real tensor names) and hands its layers' parts to the shared code
here (:class:`LayerParts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sangam.models.attention import AttentionBackend, AttentionMetadata, PagedKV
from sangam.models.config import ModelConfig
from sangam.models.kernel_table import KernelTable, kernel_table

if TYPE_CHECKING:
    from sangam.models.sharding import ShardLayout

TORCH = kernel_table("torch")


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

    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 rotary_dim: int | None = None):
        self.head_dim = head_dim
        # Partial RoPE (LLaDA2): only a head's first rotary_dim dims turn; the rest pass.
        self.rotary_dim = rotary_dim or head_dim
        self.theta = theta
        self.max_positions = max_positions
        self._table: torch.Tensor | None = None  # [2, max_positions, rotary_dim] cos | sin

    def table(self, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables ``[max_positions, rotary_dim]`` (what the fused RoPE store
        kernel reads)."""
        t = self._table
        if t is None or t.dtype != dtype or t.device != device:
            rd = self.rotary_dim
            inv = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            t = torch.stack([emb.cos(), emb.sin()]).to(dtype=dtype, device=device)
            self._table = t
        return t[0], t[1]

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[..., 1, rotary_dim]`` for positions ``[...]``, ready to broadcast over
        heads in :meth:`apply`."""
        cos, sin = self.table(dtype, positions.device)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ``[..., H, D]`` by :meth:`cos_sin` of its positions, in their dtype."""
        xf = x.to(cos.dtype)
        rd = self.rotary_dim
        xr = xf[..., :rd] if rd < self.head_dim else xf
        half = rd // 2
        rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
        out = xr * cos + rotated * sin
        if rd < self.head_dim:
            out = torch.cat([out, xf[..., rd:]], dim=-1)
        return out.to(x.dtype)


AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Sums a row-parallel projection's partial outputs across the tensor-parallel group, in place
# (``engine/tensor_group.py``'s all-reduce); None: the model is whole.
AllReduce = Callable[[torch.Tensor], torch.Tensor]


class LayerParts(NamedTuple):
    """What the shared layer code needs of one transformer layer."""

    attn_norm: nn.Module
    qkv: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # flat
    qk_norms: tuple[nn.Module, nn.Module] | None  # per-head RMSNorms on q and k, before RoPE
    o: nn.Module
    mlp_norm: nn.Module
    # (x, kernels) -> MLP(x), with the worker's kernels where the MLP has some (MoE).
    mlp: Callable[..., torch.Tensor]


class SplitQKV:
    """Separate q, k and v projections as one ``qkv`` callable."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module):
        self.q, self.k, self.v = q, k, v

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(x), self.k(x), self.v(x)


class SwiGLU:
    """A dense SwiGLU MLP, down(silu(gate(x)) * up(x)), over three projections."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor, kernels: KernelTable = TORCH) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DiffusionLM(nn.Module):
    """Base of every architecture. Subclasses build the module tree and implement the
    accessors."""

    # Tensors (by name suffix) the loader keeps in the compute dtype whatever the model's: the
    # ones a low-precision copy would change the results of (LLaDA2's expert bias).
    full_precision_tensors: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position,
                                    config.rotary_dim)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.attention_backend: AttentionBackend | None = None
        # Each sharded tensor's cut, by state-dict name (the loader sets it; a weight update
        # copies each rank's cut of a full tensor).
        self.weight_cuts: dict = {}
        # The slice of the weights this process holds (``models/sharding.py`` cuts them;
        # None: the whole model), and the all-reduce that joins the ranks' partial sums.
        self.shard: ShardLayout | None = None
        self.all_reduce: AllReduce | None = None

    @property
    def rank_config(self) -> ModelConfig:
        """The configuration with this rank's head counts: what sizes its KV pages and
        activations (the model's own when whole)."""
        return self.config if self.shard is None else self.shard.rank_config(self.config)

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes: all of them when whole."""
        cfg = self.rank_config
        return cfg.num_heads, cfg.num_kv_heads

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.all_reduce is None else self.all_reduce(x)

    # Accessors each architecture provides.
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def layer_parts(self, i: int) -> LayerParts:
        """Layer i's parts."""
        raise NotImplementedError

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def output_head(self) -> nn.Module:
        """The LM head: a Linear, or an Embedding when tied (its weight is the same
        ``[vocab, hidden]`` matrix)."""
        raise NotImplementedError

    def parts(self) -> list[LayerParts]:
        """Every layer's parts, made once (they name modules, not tensors, so they stay valid
        when weights are loaded or moved)."""
        made = self.__dict__.get("_parts")
        if made is None:
            made = self.__dict__["_parts"] = [self.layer_parts(i)
                                              for i in range(self.config.num_layers)]
        return made

    def prepare(self) -> None:
        """Lay the weights out for inference once they are loaded: each submodule with a
        ``prepare_for_inference`` (MoE layers stack their experts); the loader calls it."""
        for module in self.modules():
            prepare = getattr(module, "prepare_for_inference", None)
            if prepare is not None:
                prepare()

    # Shared computation.
    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                kernels: KernelTable = TORCH) -> torch.Tensor:
        head_dim = self.config.head_dim
        heads, kv_heads = self.local_heads
        lead = h.shape[:-1]
        cos, sin = self.rope.cos_sin(positions, compute_dtype(h.dtype))  # once, for all layers
        for i, part in enumerate(self.parts()):
            q, k, v = part.qkv(part.attn_norm(h))
            q = q.view(*lead, heads, head_dim)
            k = k.view(*lead, kv_heads, head_dim)
            if part.qk_norms is not None:
                q, k = part.qk_norms[0](q), part.qk_norms[1](k)
            q, k = self.rope.apply(q, cos, sin), self.rope.apply(k, cos, sin)
            v = v.view(*lead, kv_heads, head_dim)
            # o and the MLP's down projection are row-parallel: one all-reduce each.
            h = h + self._reduce(part.o(attend(i, q, k, v).reshape(*lead, heads * head_dim)))
            h = h + self._reduce(part.mlp(part.mlp_norm(h), kernels))
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
            return backend.forward(q, k, v, kv.k[i], kv.v[i], meta, self.scale,
                                   **kv.scales(i))

        return self._layers(self.embed(input_ids), positions, attend, kernel_table(backend.name))

    def head_weight(self) -> torch.Tensor:
        """The LM head's rows of this rank's vocabulary (``ShardLayout.vocab``): a sharded
        head holds only them, a tied one is the whole embedding, sliced."""
        w = self.output_head().weight
        vocab = self.config.vocab_size
        lo, hi = (0, vocab) if self.shard is None else self.shard.vocab(vocab)
        return w if w.shape[0] == hi - lo else w[lo:hi]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The LM head on the rows ``logits_indices`` of ``hidden`` only (under tensor
        parallelism, this rank's columns of the vocabulary)."""
        return F.linear(hidden[logits_indices], self.head_weight())

    def forward_dense(self, input_ids: torch.Tensor, key_mask: torch.Tensor | None = None,
                      block_size: int | None = None) -> torch.Tensor:
        """Plain full-sequence forward, ``[B, T] -> [B, T, vocab]``, with autograd.

        No cache and no paging: the oracle for tests and the forward used for training.
        ``key_mask [B, T]`` (bool) hides the False positions from every query (padding).
        Bidirectional, or for a block-causal model block-causal over blocks of ``block_size``
        positions (default: the model's), counted from position 0.
        """
        cfg = self.config
        heads, kv_heads = self.local_heads
        group = heads // kv_heads
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
                        self.head_weight())
