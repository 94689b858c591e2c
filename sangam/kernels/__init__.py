"""Triton kernels of the serving hot path, each with a PyTorch reference in ``reference`` (the
scoring kernel's is decoding's own: ``sangam.decoding.score_logits``).

The kernels run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set before
Triton is first imported).
"""

from sangam.kernels.fused_moe import fused_moe, moe_route
from sangam.kernels.kv_store import store_kv, store_kv_rope
from sangam.kernels.page_copy import gather_pages, scatter_pages
from sangam.kernels.paged_attention import paged_attention
from sangam.kernels.reference import (
    fused_moe_ref,
    gather_pages_ref,
    moe_route_ref,
    paged_attention_ref,
    scatter_pages_ref,
    store_kv_ref,
    store_kv_rope_ref,
)
from sangam.kernels.unmask import fused_score

__all__ = [
    "fused_moe", "fused_moe_ref", "fused_score", "gather_pages", "gather_pages_ref",
    "moe_route", "moe_route_ref", "paged_attention", "paged_attention_ref", "scatter_pages",
    "scatter_pages_ref", "store_kv", "store_kv_ref", "store_kv_rope", "store_kv_rope_ref",
]
