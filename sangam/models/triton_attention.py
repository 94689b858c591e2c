"""The Triton attention backend: the KV-store and paged-attention kernels (DESIGN.md §5)."""

from __future__ import annotations

import torch

from sangam.kernels.kv_store import store_kv
from sangam.kernels.paged_attention import paged_attention
from sangam.models.attention import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Stores the span's K/V with one kernel and attends with the paged kernel.

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (slow; for tests).
    """

    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_pages, v_pages, meta.slot_mapping)
        max_q = max(meta.query_lens, default=0)
        return paged_attention(q, k_pages, v_pages, meta.cu_seqlens_q, meta.block_tables,
                               meta.kv_lens, scale, max_query_len=max_q)
