"""Cutting a model into one rank's shard of a tensor-parallel group (docs/design.md §4.10).

Megatron's layout, read off each layer's ``LayerParts`` so that every architecture shares it:
the query/key/value projections are column-parallel (each rank computes its heads; KV heads
replicated when there are fewer than ranks), the output projection row-parallel; an MLP's
gate and up projections column-parallel, its down projection row-parallel; a mixture of
experts' experts split by width, or by expert under expert parallelism; the LM head split by
vocabulary rows. Norms, the router and the embedding stay whole. The model then sums each
row-parallel output across the group (``DiffusionLM.all_reduce``): two all-reduces a layer.

``shard_model`` turns a model built on the meta device into its rank's shapes and returns,
per tensor name, which slices of the checkpoint's tensor this rank reads (``Cut``): the
loader reads only those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sangam.models.config import ShardLayout
from sangam.models.llada2 import FusedQKV
from sangam.models.llada_moe import RoutedPlusShared
from sangam.models.moe import Expert, SparseMoe
from sangam.models.transformer import DiffusionLM, SplitQKV, SwiGLU


@dataclass(frozen=True)
class Cut:
    """This rank's part of a tensor: the ranges ``ranges`` along ``dim``, concatenated
    (a fused QKV weight takes three); ``zero``: a row-parallel bias, held whole by rank 0 and
    as zeros by the others (the all-reduce adds it once)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    zero: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        out[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(out)

    def take(self, full: object) -> torch.Tensor:
        """This rank's part of ``full`` (a tensor, or a safetensors slice read lazily)."""
        parts = []
        for a, b in self.ranges:
            index = (slice(None),) * self.dim + (slice(a, b),)
            parts.append(full[index])
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        return torch.zeros_like(t) if self.zero else t


def shard_model(model: DiffusionLM, layout: ShardLayout) -> dict[str, Cut]:
    """Give ``model`` (on the meta device, not yet loaded) the shapes of ``layout``'s shard;
    returns the cut of every tensor that is not whole, by state-dict name."""
    layout.check(model.config)
    model.shard = layout
    if layout.size == 1:
        return {}
    cuts = _cuts(model, layout)
    params = dict(model.named_parameters())
    for name, cut in cuts.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        p = params[name]
        local = torch.empty(cut.shape(tuple(p.shape)), dtype=p.dtype, device=p.device)
        setattr(module, attr, nn.Parameter(local, requires_grad=False))
    for module in model.modules():  # keep Linear's repr and features true to the shard
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
    return cuts


def _cuts(model: DiffusionLM, layout: ShardLayout) -> dict[str, Cut]:
    cfg = model.config
    hd = cfg.head_dim
    (q0, q1), (k0, k1) = layout.heads(cfg)
    names = {id(m): n for n, m in model.named_modules()}
    cuts: dict[str, Cut] = {}

    def put(module: nn.Module, weight: Cut, bias: Cut | None = None) -> None:
        cuts[f"{names[id(module)]}.weight"] = weight
        if module.bias is not None:
            cuts[f"{names[id(module)]}.bias"] = bias or weight

    def column(module: nn.Module, ranges: tuple[tuple[int, int], ...]) -> None:
        put(module, Cut(0, ranges))

    def row(module: nn.Module, a: int, b: int) -> None:
        n = module.weight.shape[0]
        put(module, Cut(1, ((a, b),)), Cut(0, ((0, n),), zero=layout.rank != 0))

    def swiglu(gate: nn.Module, up: nn.Module, down: nn.Module) -> None:
        a, b = layout.split(gate.weight.shape[0])
        column(gate, ((a, b),))
        column(up, ((a, b),))
        row(down, a, b)

    def mlp(m: object) -> None:
        if isinstance(m, SwiGLU):
            swiglu(m.gate, m.up, m.down)
        elif isinstance(m, Expert):
            swiglu(m.gate_proj, m.up_proj, m.down_proj)
        elif isinstance(m, RoutedPlusShared):
            mlp(m.routed)
            mlp(m.shared)
        elif isinstance(m, SparseMoe):
            if layout.expert_parallel:
                lo, hi = layout.split(len(m.experts))
                m.local_experts = (lo, hi)
                for j, e in enumerate(m.experts):  # the others' experts: zero width
                    if not lo <= j < hi:
                        column(e.gate_proj, ((0, 0),))
                        column(e.up_proj, ((0, 0),))
                        put(e.down_proj, Cut(1, ((0, 0),)))
            else:
                for e in m.experts:
                    mlp(e)
            if hasattr(m, "shared_experts"):
                mlp(m.shared_experts)
        else:
            raise TypeError(f"no tensor-parallel rule for the MLP {type(m).__name__}")

    for part in model.parts():
        qkv = part.qkv
        if isinstance(qkv, SplitQKV):
            column(qkv.q, ((q0 * hd, q1 * hd),))
            column(qkv.k, ((k0 * hd, k1 * hd),))
            column(qkv.v, ((k0 * hd, k1 * hd),))
        elif isinstance(qkv, FusedQKV):
            q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
            column(qkv.proj, ((q0 * hd, q1 * hd), (q + k0 * hd, q + k1 * hd),
                              (q + kv + k0 * hd, q + kv + k1 * hd)))
        else:
            raise TypeError(f"no tensor-parallel rule for the projection {type(qkv).__name__}")
        row(part.o, q0 * hd, q1 * hd)
        mlp(part.mlp)
    head = model.output_head()
    if isinstance(head, nn.Linear):  # a tied head is the embedding: whole, sliced in logits
        lo, hi = layout.vocab(cfg.vocab_size)
        column(head, ((lo, hi),))
    return cuts
