"""The Triton attention backend: the KV-store and paged-attention kernels (docs/design.md §5)."""

from __future__ import annotations

import torch

from sangam.kernels.kv_store import store_kv
from sangam.kernels.paged_attention import AttentionPlan, paged_attention, plan_attention
from sangam.models.attention import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Stores the span's K/V with one kernel and attends with the paged kernel.

    The attention launch is planned once per forward (its metadata object) and layer kind
    (DiffusionGemma's sliding and full layers differ in shape), and reused by every layer of
    that kind. Runs on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1`` (slow; for tests).
    """

    name = "triton"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plans: dict[bool, AttentionPlan] = {}  # by layer kind (sliding), for _meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding: bool = False, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None) -> torch.Tensor:
        tables, slots = meta.pages(sliding)
        store_kv(k, v, k_pages, v_pages, slots, k_scales, v_scales)
        if self._meta is not meta:
            self._meta, self._plans = meta, {}
        plan = self._plans.get(sliding)
        if plan is None:
            plan = self._plans[sliding] = plan_attention(
                q, k_pages, meta.cu_seqlens_q, tables,
                max_kv_len=max(meta.kv_lens_host, default=0),
                max_query_len=max(meta.query_lens, default=0), num_splits=meta.kv_splits(sliding))
        return paged_attention(q, k_pages, v_pages, meta.cu_seqlens_q, tables,
                               meta.kv_lens, scale, plan=plan, causal_blocks=meta.causal_blocks,
                               positions=meta.positions, key_bounds=meta.key_bounds(sliding),
                               k_scales=k_scales, v_scales=v_scales)
