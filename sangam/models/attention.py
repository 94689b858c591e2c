"""Attention over a paged K/V cache: the metadata of a packed batch and the backend interface.

Every forward — a refresh of the whole sequence or a cached step over one block — is the same
operation (docs/design.md §2): write the span's fresh K/V into its page slots, then let each query
attend, without a causal mask, over every cached position of its request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sangam.kernels.reference import paged_attention_ref, store_kv_ref
from sangam.models.config import FP8_SCALE_BYTES, ModelConfig, fp8_scale_rows


class PagedKV:
    """All layers' K and V pages: ``[layers, 2, num_pages, page_size, Hkv, D]`` per group of
    layers that share a K/V shape — one group, one tensor, for every model but DiffusionGemma,
    whose full-attention layers have heads of their own (two groups, one page numbering).

    One buffer lets the page gather/scatter kernel move every layer of a request in one launch;
    ``k[i]`` and ``v[i]`` are views of layer i's pages.

    An FP8 pool (``--kv-cache-dtype fp8``) is a uint8 buffer of pages of ``page_size + S`` rows
    (``[..., page_size + S, Hkv, D]``): the token rows hold float8_e4m3fn values, the S rows
    after them (``fp8_scale_rows``) each token's and head's fp32 scale. ``k[i]``/``v[i]`` view
    the values (rows 16-byte aligned), ``k_scales[i]``/``v_scales[i]`` ``[num_pages,
    page_size, Hkv]`` the scales. A page carries its own scales, so every page copy, transfer
    and prefix-cache hit moves them with it.
    """

    def __init__(self, buffer: torch.Tensor):
        """``buffer`` holds every layer."""
        self._index([(buffer, range(buffer.shape[0]))])

    @classmethod
    def grouped(cls, groups: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> PagedKV:
        """Layers in several tensors: ``(tensor, the layers it holds, in order)`` each."""
        kv = object.__new__(cls)
        kv._index(groups)
        return kv

    def _index(self, groups: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        self.buffers = [t for t, _ in groups]
        slots = {i: (b, j) for b, (_, layers) in enumerate(groups) for j, i in enumerate(layers)}
        # Layer i lives at buffers[b][j]: (b, j) per layer (what K/V transfers walk).
        self.layer_slots = [slots[i] for i in range(len(slots))]
        self.fp8 = self.buffers[0].dtype == torch.uint8
        pages = [self.buffers[b][j] for b, j in self.layer_slots]  # [2, P, page, Hkv, D(+4)]
        if self.fp8:
            self.k, self.k_scales = map(list, zip(*(_fp8_views(t[0]) for t in pages)))
            self.v, self.v_scales = map(list, zip(*(_fp8_views(t[1]) for t in pages)))
        else:
            self.k = [t[0] for t in pages]
            self.v = [t[1] for t in pages]

    def scales(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's FP8 scales as the attention backends take them (none for other pools)."""
        return {"k_scales": self.k_scales[i], "v_scales": self.v_scales[i]} if self.fp8 else {}

    @property
    def buffer(self) -> torch.Tensor:
        """The one tensor of every layer (what K/V transfers move)."""
        if len(self.buffers) > 1:
            raise ValueError("this pool's layers have K/V shapes of their own (DiffusionGemma): "
                             "no single buffer holds them")
        return self.buffers[0]

    def page_bytes(self) -> int:
        """One page of every layer's K and V."""
        return sum(2 * t[0, 0, 0].numel() * t.element_size() * t.shape[0]
                   for t in self.buffers)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.buffers[0].shape[2]

    @classmethod
    def allocate(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> PagedKV:
        shape = (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def for_model(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: torch.device | str, empty: bool = False, fp8: bool = False,
                  window_pages: int | None = None) -> PagedKV:
        """Pages for every layer of ``cfg`` (each layer's own K/V shape: ``layer_kv_shape``);
        ``empty``: uninitialised (pages are written before they are read); ``fp8``: the FP8
        layout (values and per-row scales, whatever ``dtype`` the model computes in);
        ``window_pages``: a hybrid pool, whose sliding-window layers have that many pages of
        their own (numbered apart, zeroed: a ring's slot outside a query's window may hold
        nothing written, ``sched/window_rings.py``)."""
        window = set(cfg.window_layers) if window_pages is not None else set()
        groups: dict[tuple[bool, int, int], list[int]] = {}
        for i in range(cfg.num_layers):
            groups.setdefault((i in window, *cfg.layer_kv_shape(i)), []).append(i)
        return cls.grouped([
            ((torch.empty if empty and not ring else torch.zeros)(
                (len(layers), 2, window_pages if ring else num_pages,
                 page_size + (fp8_scale_rows(page_size, d) if fp8 else 0), heads, d),
                dtype=torch.uint8 if fp8 else dtype, device=device), layers)
            for (ring, heads, d), layers in groups.items()])


def _fp8_views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 layer's K (or V) pages ``[P, page_size + S, Hkv, D]`` (bytes) as its values
    ``[P, page_size, Hkv, D]`` (float8_e4m3fn) and their scales ``[P, page_size, Hkv]``."""
    _, rows, heads, d = pages.shape
    page_size = next(p for p in range(rows, 0, -1) if p + fp8_scale_rows(p, d) == rows)
    values = pages[:, :page_size].view(torch.float8_e4m3fn)
    scale_bytes = pages[:, page_size:].flatten(1)[:, :page_size * heads * FP8_SCALE_BYTES]
    return values, scale_bytes.view(torch.float32).unflatten(1, (page_size, heads))


@dataclass
class AttentionMetadata:
    """Where the packed queries of one forward come from and what they attend to.

    Request r owns query rows ``cu_seqlens_q[r]:cu_seqlens_q[r+1]`` and attends over its first
    ``kv_lens[r]`` cached positions, stored in pages ``block_tables[r]``. Row i's fresh K/V goes
    to flat slot ``slot_mapping[i]`` (page * page_size + offset; -1 = do not store). A
    block-causal model's batch also carries each request's block size (``causal_blocks``) and
    each query's position (``positions``): a query sees only keys of its block and earlier ones.
    """

    cu_seqlens_q: torch.Tensor  # int32 [R + 1]
    kv_lens: torch.Tensor  # int32 [R]
    block_tables: torch.Tensor  # int32 [R, max_pages]
    slot_mapping: torch.Tensor  # int64 [N]
    query_lens: list[int]  # host copies, so backends need no device sync
    kv_lens_host: list[int]
    causal_blocks: torch.Tensor | None = None  # int32 [R]; None: bidirectional
    positions: torch.Tensor | None = None  # int64 [N], with causal_blocks
    # The attention's KV split count, when fixed by the caller (a CUDA graph freezes it at
    # capture): one for every layer, or (full layers', sliding layers') for DiffusionGemma's
    # two shapes; None: planned from the lengths (kernels.paged_attention.kv_splits).
    num_kv_splits: int | tuple[int, int] | None = None
    # Per-query key bounds (DiffusionGemma, docs/design.md §2.12): query i sees its request's
    # keys [key_lo[i], key_hi[i]), or in a sliding-window layer [window_lo[i], key_hi[i]).
    # None: every key up to kv_lens.
    key_lo: torch.Tensor | None = None  # int32 [N]
    key_hi: torch.Tensor | None = None
    window_lo: torch.Tensor | None = None
    # A hybrid pool (sched/window_rings.py): the sliding-window layers' own block tables (each
    # request's ring, repeated) and slots. None: every layer reads block_tables.
    window_block_tables: torch.Tensor | None = None  # int32 [R, max_pages]
    window_slot_mapping: torch.Tensor | None = None  # int64 [N]

    def key_bounds(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's per-query key bounds (``sliding``: a sliding-window layer), if any."""
        if self.key_hi is None:
            return None
        return (self.window_lo if sliding else self.key_lo), self.key_hi

    def kv_splits(self, sliding: bool) -> int | None:
        """A layer's fixed KV split count (``num_kv_splits``), if any."""
        s = self.num_kv_splits
        return s[sliding] if isinstance(s, tuple) else s

    def pages(self, sliding: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's block tables and slot mapping (``sliding``: a sliding-window layer)."""
        if sliding and self.window_block_tables is not None:
            return self.window_block_tables, self.window_slot_mapping
        return self.block_tables, self.slot_mapping

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    """Stores a span's K/V into pages and attends over them."""

    name: str

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding: bool = False, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """q ``[N, Hq, D]``, k/v ``[N, Hkv, D]`` (RoPE applied) -> output ``[N, Hq, D]``;
        ``sliding``: a sliding-window layer (``AttentionMetadata.key_bounds``); FP8 pages come
        with their scales (``PagedKV.scales``)."""


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch reference: exact, per request, any dtype and device. The CPU default."""

    name = "torch"

    def forward(self, q, k, v, k_pages, v_pages, meta, scale, sliding=False, k_scales=None,
                v_scales=None):
        tables, slots = meta.pages(sliding)
        store_kv_ref(k, v, k_pages, v_pages, slots, k_scales, v_scales)
        return paged_attention_ref(q, k_pages, v_pages, meta.cu_seqlens_q, tables,
                                   meta.kv_lens, scale, query_lens=meta.query_lens,
                                   kv_lens_host=meta.kv_lens_host,
                                   causal_blocks=meta.causal_blocks, positions=meta.positions,
                                   key_bounds=meta.key_bounds(sliding), k_scales=k_scales,
                                   v_scales=v_scales)
