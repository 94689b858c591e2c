"""DiffusionGemma (``DiffusionGemmaForBlockDiffusion``): Gemma-4 layers run as a causal encoder
over the prompt and every finished canvas, and as a bidirectional decoder over the current
canvas (docs/design.md §6, §2.12). Tensor names as transformers writes them.

One set of weights serves both passes (transformers ties them; the checkpoint holds the
decoder's copy, ``model.decoder.*``), except each layer's ``layer_scalar``, a buffer the
encoder and the decoder keep apiece. A layer: pre-norm attention with per-head q/k norms and
a scale-free v norm, attention scaling 1; sliding-window layers (plain RoPE) and full layers
(their own head_dim and KV heads, V = the normed K projection, proportional RoPE); then a dense
GeGLU MLP and softmax-routed GeGLU experts in parallel, each with its norms, summed and
normed; the layer's output times its scalar. The decoder adds self-conditioning: the previous
step's processed logits, as soft embeddings through a gated MLP, added to its input
embeddings. Logits are the tied head's, soft-capped in fp32.

Where transformers computes in a fixed precision, so does this, so that a float64 model
equals the reference to rounding: every RMSNorm in fp32 (``x.float()``), RoPE angles and
cos/sin in fp32, the router's softmax in fp32, logits in fp32. The vision tower is not
loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from sangam.models.attention import AttentionMetadata, PagedKV
from sangam.models.config import ModelConfig
from sangam.models.kernel_table import KernelTable, kernel_table
from sangam.models.transformer import TORCH, DiffusionLM


class GemmaRMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 [* weight], always in fp32, back in x's dtype."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))
        self.with_scale = with_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            h = h * self.weight.float()
        return h.type_as(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GemmaMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)): the dense MLP, and self-conditioning's."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        kv_heads, head_dim = cfg.layer_kv_shape(i)
        self.sliding = cfg.gemma.sliding[i]
        self.head_dim = head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * head_dim, bias=False)
        if self.sliding:  # full layers: V is the K projection (then v-normed, not RoPE'd)
            self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * head_dim, cfg.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.v_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps, with_scale=False)


class GemmaRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.moe.num_experts))
        self.root = cfg.hidden_size ** -0.5


class GemmaExperts(nn.Module):
    """All experts' weights as the kernels want them: gate_up_proj ``[E, 2I, H]`` (gate rows,
    then up rows) and down_proj ``[E, H, I]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.gate_up_proj = nn.Parameter(torch.empty(m.num_experts, 2 * m.intermediate_size,
                                                     cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size,
                                                  m.intermediate_size))
        self.local_experts = (0, m.num_experts)  # [start, end): those this rank holds (EP)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, i)
        self.mlp = GemmaMLP(d, cfg.intermediate_size)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1",
                     "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(d, eps))
        self.register_buffer("layer_scalar", torch.ones(1))  # the decoder's
        self.router = GemmaRouter(cfg)
        self.experts = GemmaExperts(cfg)


class LayerScalar(nn.Module):
    """The encoder's own ``layer_scalar`` of one layer (all the encoder does not share)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("layer_scalar", torch.ones(1))


class SelfConditioning(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.pre_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, with_scale=False)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, embeds: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(soft)
        return self.post_norm(embeds + self.down_proj(gelu_tanh(self.gate_proj(n))
                                                      * self.up_proj(n)))


def rope_inv_freq(head_dim: int, theta: float, fraction: float = 1.0,
                  proportional: bool = False) -> torch.Tensor:
    """fp32 inverse frequencies ``[head_dim / 2]`` over a rotate-half head: plain RoPE, or
    proportional RoPE (the first ``fraction`` of the angles turn, at exponents over the whole
    head_dim; the rest are 0, so those dims pass unrotated)."""
    if not proportional:
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    turning = int(fraction * head_dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64)
                               .to(torch.float) / head_dim))
    return torch.cat([rotated, torch.zeros(head_dim // 2 - turning, dtype=torch.float)])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[..., H, D]``; cos/sin ``[..., D]`` in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


# attend(layer, q [.., Hq, D], k [.., Hkv, D], v [.., Hkv, D]) -> [.., Hq, D]
GemmaAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DiffusionGemmaModel(DiffusionLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.model = nn.Module()
        dec = self.model.decoder = nn.Module()
        dec.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        dec.layers = nn.ModuleList(GemmaLayer(cfg, i) for i in range(cfg.num_layers))
        dec.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dec.self_conditioning = SelfConditioning(cfg)
        enc = self.model.encoder = nn.Module()
        enc.language_model = nn.Module()
        enc.language_model.layers = nn.ModuleList(LayerScalar() for _ in range(cfg.num_layers))
        self._inv_freq: dict[tuple[bool, torch.device], torch.Tensor] = {}

    # The pieces of a pass.
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.model.decoder.embed_tokens.weight
        return F.embedding(ids, w) * self.embed_scale(w.dtype)

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden), rounded to the weights' dtype as transformers rounds it."""
        return torch.tensor(math.sqrt(self.config.hidden_size), dtype=dtype)

    def rope_cos_sin(self, positions: torch.Tensor, sliding: bool,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[..., head_dim]`` of a layer type, computed in fp32, in ``dtype``."""
        inv = self._inv_freq.get((sliding, positions.device))
        if inv is None:  # built on first use: the model may be made on the meta device
            cfg, g = self.config, self.config.gemma
            with torch.device("cpu"):
                inv = (rope_inv_freq(cfg.head_dim, cfg.rope_theta) if sliding else
                       rope_inv_freq(g.full_head_dim, g.full_rope_theta, g.full_rope_fraction,
                                     proportional=True))
            inv = self._inv_freq[sliding, positions.device] = inv.to(positions.device)
        freqs = positions.float()[..., None] * inv
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def output_head(self) -> nn.Module:
        return self.model.decoder.embed_tokens

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.norm(h)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Soft-capped fp32 logits of final-normed ``hidden`` rows (transformers casts the
        head's output to fp32 before the cap); with autograd, for training."""
        cap = self.config.gemma.logit_softcap
        raw = F.linear(hidden, self.head_weight()).to(torch.float32)
        return torch.tanh(raw / cap) * cap

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """:meth:`head` of the rows ``logits_indices`` only."""
        return self.head(hidden[logits_indices])

    def soft_embeddings(self, processed_logits: torch.Tensor) -> torch.Tensor:
        """Self-conditioning's input from one step's processed (temperature-scaled) logits
        ``[C, V]``: softmax(logits) @ E * sqrt(hidden) ``[C, hidden]``, in the weights' dtype.
        The next step of the canvas adds it, through :class:`SelfConditioning`, to its input
        embeddings; it is what a request keeps between steps (not the ``[C, V]`` logits)."""
        w = self.model.decoder.embed_tokens.weight
        probs = processed_logits.to(w.dtype).softmax(-1, dtype=torch.float32).to(w.dtype)
        return (probs @ w) * self.embed_scale(w.dtype)

    def decoder_inputs(self, canvas: torch.Tensor,
                       soft: torch.Tensor | None) -> torch.Tensor:
        """The decoder's input embeddings of a canvas, self-conditioned on ``soft``
        (:meth:`soft_embeddings`; None at a canvas's first step: zeros)."""
        e = self.embed(canvas)
        return self.model.decoder.self_conditioning(e, torch.zeros_like(e) if soft is None
                                                    else soft.to(e.dtype))

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, attend: GemmaAttend,
                   encoder: bool | torch.Tensor, kernels: KernelTable = TORCH) -> torch.Tensor:
        """The layers over ``h`` ``[N, hidden]`` (final-normed). ``encoder`` picks whose
        layer scalars apply: all rows the encoder's or the decoder's, or per row (a bool
        ``[N]``, True: an encoder row); ``attend`` stores and attends (the caller's masks)."""
        cfg = self.config
        lead = h.shape[:-1]
        ropes = {s: self.rope_cos_sin(positions, s, h.dtype) for s in set(cfg.gemma.sliding)}
        enc = self.model.encoder.language_model.layers
        mixed = isinstance(encoder, torch.Tensor)
        for i, layer in enumerate(self.model.decoder.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            cos, sin = ropes[a.sliding]
            q = apply_rope(a.q_norm(a.q_proj(x).view(*lead, -1, a.head_dim)), cos, sin)
            k_raw = a.k_proj(x).view(*lead, -1, a.head_dim)
            v = a.v_norm(a.v_proj(x).view(*lead, -1, a.head_dim) if a.sliding else k_raw)
            k = apply_rope(a.k_norm(k_raw), cos, sin)
            # o, the dense down projection and the experts are row-parallel under tensor
            # parallelism: each sum is whole before its norm (three all-reduces a layer).
            out = self._reduce(a.o_proj(attend(i, q, k, v).reshape(*lead, -1)))
            h = h + layer.post_attention_layernorm(out)
            dense = layer.post_feedforward_layernorm_1(
                self._reduce(layer.mlp(layer.pre_feedforward_layernorm(h))))
            routed = layer.post_feedforward_layernorm_2(
                self._reduce(self._experts(layer, h, kernels)))
            h = h + layer.post_feedforward_layernorm(dense + routed)
            if mixed:
                h = h * torch.where(encoder[..., None], enc[i].layer_scalar, layer.layer_scalar)
            else:
                h = h * (enc[i] if encoder else layer).layer_scalar
        return self.final_norm(h)

    # The paged pass: the engine's.
    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, kv: PagedKV,
                      canvas: CanvasRows | None = None) -> torch.Tensor:
        """One packed forward: encoder rows (a prompt, a prefill chunk, a finished canvas)
        and decoder rows (``canvas``: which rows, and their self-conditioning), each request's
        K/V stored and attended as ``meta``'s per-row key bounds say (docs/design.md §2.12).
        Final-normed hidden states ``[N, hidden]``."""
        backend = self.attention_backend
        if backend is None:
            raise RuntimeError("no attention backend set on the model")
        sliding = self.config.gemma.sliding

        def attend(i, q, k, v):
            return backend.forward(q, k, v, kv.k[i], kv.v[i], meta, 1.0, sliding=sliding[i],
                                   **kv.scales(i))

        h = self.embed(input_ids)
        encoder: bool | torch.Tensor = True
        if canvas is not None and canvas.rows.numel():
            h = h.index_copy(0, canvas.rows, self.model.decoder.self_conditioning(
                h[canvas.rows], canvas.soft.to(h.dtype)))
            encoder = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
            encoder[canvas.rows] = False
        return self.run_layers(h, positions, attend, encoder, kernel_table(backend.name))

    def _experts(self, layer: GemmaLayer, h: torch.Tensor, kernels: KernelTable) -> torch.Tensor:
        """The routed experts over ``h`` (the residual stream): routed from it by the router's
        own norm, fed its pre_feedforward_layernorm_2."""
        r, m = layer.router, self.config.moe
        flat = h.reshape(-1, h.shape[-1])
        scores = r.proj(r.norm(flat) * r.scale * r.root)
        weights, ids = kernels.moe_route(scores.float(), top_k=m.top_k, score="softmax",
                                         renormalize=True)
        weights = weights * r.per_expert_scale[ids.long()]
        x = layer.pre_feedforward_layernorm_2(flat)
        e = layer.experts
        lo, hi = e.local_experts
        partial = hi - lo < m.num_experts
        if partial:  # expert parallelism: the others' experts are id hi - lo, skipped
            ids = torch.where((ids >= lo) & (ids < hi), ids - lo, hi - lo)
        out = kernels.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids,
                                partial=partial, activation=m.activation)
        return out.view(h.shape)

    # The dense passes (no pages): the oracle of the paged ones, and the reference decoder's.
    @torch.inference_mode()
    def encode(self, ids: torch.Tensor, cache: DenseKV, kernels: KernelTable = TORCH) -> None:
        """The encoder over ``ids`` ``[T]`` at the cache's next positions: causal (sliding
        layers: the last ``sliding_window`` positions, the query's own included); appends the
        span's K/V to ``cache``."""
        start = cache.length
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        window = self.config.gemma.sliding_window

        def attend(i, q, k, v):
            keys = cache.extend(i, k, v)
            kpos = torch.arange(keys[0].shape[0], device=ids.device)
            mask = kpos[None, :] <= positions[:, None]
            if self.config.gemma.sliding[i]:
                mask &= kpos[None, :] > positions[:, None] - window
            return _attention(q, *keys, mask)

        self.run_layers(self.embed(ids), positions, attend, encoder=True, kernels=kernels)
        cache.length += ids.shape[0]

    @torch.inference_mode()
    def decode(self, canvas: torch.Tensor, cache: DenseKV, soft: torch.Tensor | None = None,
               kernels: KernelTable = TORCH) -> torch.Tensor:
        """fp32 logits ``[C, vocab]`` of :meth:`decode_hidden`."""
        return self.head(self.decode_hidden(canvas, cache, soft, kernels))

    @torch.inference_mode()
    def decode_hidden(self, canvas: torch.Tensor, cache: DenseKV,
                      soft: torch.Tensor | None = None,
                      kernels: KernelTable = TORCH) -> torch.Tensor:
        """The decoder over ``canvas`` ``[C]`` right after the cached positions: every
        canvas position sees the whole canvas and the cached K/V (sliding layers: its last
        ``sliding_window - 1`` positions, as transformers' sliding cache keeps them); the cache
        is not written. Final-normed hidden states ``[C, hidden]``."""
        n = cache.length
        positions = torch.arange(n, n + canvas.shape[0], device=canvas.device)
        window = self.config.gemma.sliding_window

        def attend(i, q, k, v):
            ck, cv = cache.layers[i]
            lo = max(0, n - (window - 1)) if self.config.gemma.sliding[i] else 0
            keys = torch.cat([ck[lo:], k]), torch.cat([cv[lo:], v])
            return _attention(q, *keys, None)

        return self.run_layers(self.decoder_inputs(canvas, soft), positions, attend,
                               encoder=False, kernels=kernels)


def canvas_key_bounds(positions: np.ndarray, canvas_start: np.ndarray, canvas_end: np.ndarray,
                      window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's keys (``AttentionMetadata.key_lo/key_hi/window_lo``, int32): an encoder row
    (``canvas_end`` 0) at p sees [0, p] causally, in a sliding layer the last ``window``
    positions (p - window, p]; a decoder row of the canvas [s, e) sees [0, e), in a sliding
    layer the last window - 1 positions before the canvas and the canvas: [s - window + 1,
    e)."""
    dec = canvas_end > 0
    hi = np.where(dec, canvas_end, positions + 1)
    lo = np.maximum(np.where(dec, canvas_start, positions) - window + 1, 0)
    return (np.zeros(len(positions), dtype=np.int32), hi.astype(np.int32), lo.astype(np.int32))


@dataclass
class CanvasRows:
    """The decoder rows of a packed forward: their indices (int64 ``[M]``) and their
    self-conditioning (``soft_embeddings``, zeros at a canvas's first step; ``[M, hidden]``)."""

    rows: torch.Tensor
    soft: torch.Tensor


class DenseKV:
    """One request's encoder K/V, every layer in full (``[length, Hkv, D]`` each)."""

    def __init__(self, model: DiffusionGemmaModel):
        cfg = model.config
        p = model.head_weight()  # never FP8: the model's dtype
        self.layers = []
        for i in range(cfg.num_layers):
            heads, dim = cfg.layer_kv_shape(i)
            empty = torch.empty(0, heads, dim, dtype=p.dtype, device=p.device)
            self.layers.append((empty, empty))
        self.length = 0

    def extend(self, i: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.layers[i]
        self.layers[i] = (torch.cat([ck, k]), torch.cat([cv, v]))
        return self.layers[i]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """q ``[T, Hq, D]`` over k/v ``[S, Hkv, D]`` (GQA), scaling 1, ``mask`` ``[T, S]`` (True:
    attend) or None (all)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    return out.transpose(0, 1)
