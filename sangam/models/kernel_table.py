"""The one table that picks, for a worker, the Triton kernels or their PyTorch references
(docs/design.md §5): attention and KV store (the attention backend), the mixture of experts'
routing and GEMMs, the K/V transfer's page gather and scatter, and the fused scoring kernels.
The choice is made once, by name (``--attention-backend``: ``triton`` by default on a GPU,
``torch`` elsewhere: ``backend_name``), and every part reads its row of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sangam.kernels import reference
from sangam.kernels.fused_moe import fused_moe, moe_route
from sangam.kernels.page_copy import gather_pages, scatter_pages
from sangam.kernels.unmask import fused_score, fused_shard_scores
from sangam.models.attention import AttentionBackend, TorchAttentionBackend
from sangam.models.triton_attention import TritonAttentionBackend


@dataclass(frozen=True)
class KernelTable:
    name: str  # the attention backend's name, which picks the row
    attention: type[AttentionBackend]
    moe_route: Callable
    fused_moe: Callable
    gather_pages: Callable
    scatter_pages: Callable
    # Scoring (docs/design.md §5.3): the fused kernel of whole rows, and of a vocabulary
    # shard's columns; None: decoding's references (``score_logits``, ``shard_scores``).
    fused_score: Callable | None
    fused_shard_scores: Callable | None


KERNEL_TABLE = {
    "triton": KernelTable("triton", TritonAttentionBackend, moe_route, fused_moe, gather_pages,
                          scatter_pages, fused_score, fused_shard_scores),
    "torch": KernelTable("torch", TorchAttentionBackend, reference.moe_route_ref,
                         reference.fused_moe_ref, reference.gather_pages_ref,
                         reference.scatter_pages_ref, None, None),
}


def kernel_table(name: str) -> KernelTable:
    """The row of ``name`` (``config.ATTENTION_BACKENDS``, tested to be this table's keys)."""
    if name not in KERNEL_TABLE:
        raise ValueError(f"attention backend must be one of {tuple(KERNEL_TABLE)}, got "
                         f"{name!r}")
    return KERNEL_TABLE[name]


def backend_name(device: torch.device, requested: str | None = None) -> str:
    """``requested``, or the default for ``device``: Triton on a GPU, the references on CPU."""
    return requested or ("triton" if device.type == "cuda" else "torch")
