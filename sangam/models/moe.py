"""A mixture-of-experts MLP layer: the router, the routed SwiGLU experts and the shared ones.

The module tree keeps the checkpoints' tensor names (``gate.weight``, ``gate.expert_bias``,
``experts.E.{gate,up,down}_proj``, ``shared_experts.*``), one Linear per expert. The kernels
want each projection of all experts as one tensor, so :meth:`SparseMoe.stacked` copies them
once into ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` and re-points every
expert's weights at views of those: no second copy stays in memory, and the state dict still
reads under the real names.

Routing and the experts run through the worker's row of the kernel table (``kernel_table.py``):
the Triton kernels (``moe_route``, ``fused_moe``) or their PyTorch references.

Under expert parallelism a rank holds only the experts ``local_experts`` (the others are left
zero-width by ``models/sharding.py``): every rank routes every token alike, computes
its own experts' share, and the layer's all-reduce sums the shares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sangam.models.config import MoeConfig
from sangam.models.kernel_table import KernelTable
from sangam.models.quantization import Fp8Linear
from sangam.models.transformer import TORCH, compute_dtype


def _stack(experts: list, attr: str) -> torch.Tensor:
    """Each expert's gate then up ``attr`` as one ``[E, gate rows + up rows, ...]`` tensor."""
    return torch.stack([torch.cat([getattr(e.gate_proj, attr), getattr(e.up_proj, attr)])
                        for e in experts])


def _repoint(experts: list, attr: str, s13: torch.Tensor, s2: torch.Tensor, half: int) -> None:
    """Point each expert's ``attr`` at its views of the stacked tensors (no second copy)."""
    for j, e in enumerate(experts):
        setattr(e.gate_proj, attr, nn.Parameter(s13[j, :half], requires_grad=False))
        setattr(e.up_proj, attr, nn.Parameter(s13[j, half:], requires_grad=False))
        setattr(e.down_proj, attr, nn.Parameter(s2[j], requires_grad=False))


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, kernels: KernelTable = TORCH) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """The gate: logits = x W^T in fp32 (fp64 for fp64 models), and the expert bias that
    steers the choice (kept in that precision by the loader)."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)


class SparseMoe(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.moe = moe
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(Expert(hidden, moe.intermediate_size)
                                     for _ in range(moe.num_experts))
        if moe.shared_intermediate_size:
            self.shared_experts = Expert(hidden, moe.shared_intermediate_size)
        self.local_experts = (0, moe.num_experts)  # [start, end): the ones this rank holds

    def prepare_for_inference(self) -> None:
        """Stack the experts now (``DiffusionLM.prepare``), not in the first forward."""
        self.stacked()

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(w13, w2, the FP8 scales as ``fused_moe`` keywords: empty unless the experts are
        ``Fp8Linear``) of all experts, stacked once: later calls find expert 0's weight a view
        of w13 and return the same tensors; after weights were replaced or moved they stack
        anew."""
        lo, hi = self.local_experts
        experts = self.experts[lo:hi]
        made = self.__dict__.get("_stacked")
        if made is not None and experts[0].gate_proj.weight.data_ptr() == made[0].data_ptr():
            return made
        width = experts[0].gate_proj.weight.shape[0]  # this rank's share of it, when split
        # Plain tensors even when first called inside a forward's inference mode: they become
        # the parameters' storage.
        with torch.inference_mode(False), torch.no_grad():
            w13 = _stack(experts, "weight")
            w2 = torch.stack([e.down_proj.weight for e in experts])
            scales: dict = {}
            gate = experts[0].gate_proj
            fmt = gate.fmt if isinstance(gate, Fp8Linear) else None
            if fmt is not None and fmt.weights == "tensor":  # one scale per channel, copied
                s13 = torch.stack([torch.cat([e.gate_proj.scale.expand(width),
                                              e.up_proj.scale.expand(width)])
                                   for e in experts])
                s2 = torch.stack([e.down_proj.scale.expand(e.down_proj.out_features)
                                  for e in experts])
                scales = {"w13_scale": s13, "w2_scale": s2, "block_weights": False}
            elif fmt is not None:  # their scales stacked alike, the experts' views of them
                block = fmt.weights == "block"
                half = gate.scale.shape[0]
                s13 = _stack(experts, fmt.scale_name)
                s2 = torch.stack([e.down_proj.scale for e in experts])
                _repoint(experts, fmt.scale_name, s13, s2, half)
                scales = {"w13_scale": s13 if block else s13.flatten(1),
                          "w2_scale": s2 if block else s2.flatten(1), "block_weights": block}
            _repoint(experts, "weight", w13, w2, width)
        self.__dict__["_stacked"] = (w13, w2, scales)
        return w13, w2, scales

    def route(self, x: torch.Tensor, kernels: KernelTable = TORCH
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[N, H]`` -> (combine weights ``[N, top_k]``, expert ids ``[N, top_k]``)."""
        m, cd = self.moe, compute_dtype(x.dtype)
        logits = F.linear(x.to(cd), self.gate.weight.to(cd))
        bias = self.gate.expert_bias.to(cd) if m.expert_bias else None
        return kernels.moe_route(logits, top_k=m.top_k, score=m.score, bias=bias, n_group=m.n_group,
                         topk_group=m.topk_group, renormalize=m.renormalize, scale=m.scale)

    def forward(self, x: torch.Tensor, kernels: KernelTable = TORCH) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.route(flat, kernels)
        lo, hi = self.local_experts
        if hi - lo < self.moe.num_experts:  # the experts of other ranks: id hi - lo, skipped
            ids = torch.where((ids >= lo) & (ids < hi), ids - lo, hi - lo)
        w13, w2, scales = self.stacked()
        out = kernels.fused_moe(flat, w13, w2, weights, ids,
                                partial=hi - lo < self.moe.num_experts, **scales)
        if self.moe.shared_intermediate_size:
            out = out + self.shared_experts(flat)
        return out.view(*lead, x.shape[-1])
