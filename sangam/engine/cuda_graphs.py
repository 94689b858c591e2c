"""CUDA graphs for decode batches: one captured transformer body per (batch-size bucket, KV split
count).

A cached decode step is small (one block of queries per request), so on a GPU its cost is
dominated by launching ~10 kernels per layer from Python. Batches whose requests all run spans
of exactly ``span`` query tokens (DualCache steps at the default block length; refreshes are
never that short in practice, and if one is, the graph computes it just as well) are padded to
the next captured batch size and replayed from one graph. The LM head stays eager: how many
logits rows a step needs varies.

Padding requests have ``kv_len`` 0 (attention gives them zeros) and store nothing (slot -1), and
are never read back. Graphs replay with the shapes and host values of their capture:
``query_lens`` is ``[span] * bucket`` and the block-table width is the most pages any request
can hold, so only the Triton backend (which reads kv_lens and tables on the device) can be
captured; the PyTorch backend runs the same padded batches eagerly, which is how the padding is
tested on CPU.

The attention launch plan is the one host decision that depends on the batch beyond its size:
its KV split count (``kernels.paged_attention.kv_splits``, from the real request count and the
longest KV length; tiles follow ``span`` alone). A graph freezes it, so each bucket has one
graph per split count its batches can get, and a batch replays the graph of its own count,
forced into the capture's metadata: real rows see exactly the launches (tiles, splits, each
request's split ranges from its device ``kv_len``) of the eager path. Counts are powers of two
and only batches too small to fill the GPU split, so the extra graphs are few and small: on an
H200, 6 for LLaDA-8B and 18 for Dream-7B beside the 20 buckets of 256 requests, all in buckets
of at most 32 requests. They are captured at start-up with the buckets, not lazily inside a
step: a capture costs warm-up forwards, and its memory is then reserved before serving. All
graphs share one memory pool (they never run concurrently), so the extras add only their
output buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.engine.host_batch import PackedBatch
from sangam.kernels.paged_attention import kv_splits
from sangam.models.attention import AttentionMetadata, PagedKV
from sangam.models.transformer import DiffusionLM


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch_size``
    (which is always included), as vLLM does — padding wastes at most 15 requests' work."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


class DecodeGraphRunner:
    """Runs :meth:`DiffusionLM.hidden_states` for uniform-span batches from static buffers,
    replaying a CUDA graph per (batch-size bucket, KV split count) (``use_graphs``) or
    eagerly."""

    def __init__(self, model: DiffusionLM, kv: PagedKV, span: int, max_batch_size: int,
                 max_pages: int, device: torch.device, use_graphs: bool = True):
        self.model = model
        self.kv = kv
        self.span = span
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_pages = max_pages
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.runs = 0  # batches served from the static buffers (observability, tests)
        # Each bucket's split counts: every power of two up to its smallest batch's count at
        # the longest context (kv_splits is monotone in both).
        longest = max_pages * kv.page_size
        self.split_counts: dict[int, list[int]] = {}
        for smallest, bucket in zip([1, *(b + 1 for b in self.sizes)], self.sizes):
            top = self.kv_splits(smallest, longest)
            self.split_counts[bucket] = [1 << i for i in range(top.bit_length())]
        most, n = self.sizes[-1], self.sizes[-1] * span
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(0, n + 1, span, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(most, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(most, max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if use_graphs:
            self._capture()

    def kv_splits(self, num_requests: int, max_kv_len: int) -> int:
        """The KV split count the eager forward plans for ``num_requests`` spans whose longest
        KV length is ``max_kv_len``."""
        cfg = self.model.config
        return kv_splits(num_requests * self.span, self.span, max_kv_len, cfg.num_heads,
                         cfg.num_kv_heads, cfg.head_dim, self.kv.buffer.dtype, self.device)

    def graph_key(self, batch: PackedBatch) -> tuple[int, int]:
        """(bucket, split count) of the graph that runs ``batch``."""
        n = len(batch.kv_lens)
        bucket = next(b for b in self.sizes if b >= n)
        return bucket, self.kv_splits(n, int(batch.kv_lens.max()))

    def can_run(self, batch: PackedBatch) -> bool:
        n = len(batch.kv_lens)
        if not (0 < n <= self.sizes[-1] and batch.block_tables.shape[1] <= self.max_pages
                and bool((np.diff(batch.cu_seqlens_q) == self.span).all())):
            return False
        bucket, splits = self.graph_key(batch)
        return splits in self.split_counts[bucket]

    def run(self, batch: PackedBatch, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` of the batch's N query rows, from ``dev``, its uploaded
        ``device_arrays()``. With graphs, a view of the graph's output buffer: valid until the
        next call."""
        n = len(batch.kv_lens)
        bucket, splits = key = self.graph_key(batch)
        rows, width = n * self.span, batch.block_tables.shape[1]
        self.input_ids[:rows].copy_(dev["input_ids"])
        self.positions[:rows].copy_(dev["positions"])
        self.slot_mapping[:rows].copy_(dev["slot_mapping"])
        self.kv_lens[:n].copy_(dev["kv_lens"])
        if n < bucket:  # padding requests: store nothing, attend to nothing
            self.slot_mapping[rows:bucket * self.span].fill_(-1)
            self.kv_lens[n:bucket].zero_()
        self.block_tables[:n, :width].copy_(dev["block_tables"])
        self.runs += 1
        if self.use_graphs:
            self.graphs[key].replay()
            return self.outputs[key][:rows]
        kv_host = [*batch.kv_lens.tolist(), *[0] * (bucket - n)]
        return self._body(bucket, splits, kv_host)[:rows]

    def _body(self, bucket: int, splits: int, kv_lens_host: list[int]) -> torch.Tensor:
        rows = bucket * self.span
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:bucket + 1], kv_lens=self.kv_lens[:bucket],
            block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:rows],
            query_lens=[self.span] * bucket, kv_lens_host=kv_lens_host, num_kv_splits=splits)
        return self.model.hidden_states(self.input_ids[:rows], self.positions[:rows], meta,
                                        self.kv)

    def _capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest reserved.
        for bucket in reversed(self.sizes):
            kv_host = [0] * bucket  # unused by the Triton backend; kv_lens are read on device
            for splits in reversed(self.split_counts[bucket]):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks kernels
                    for _ in range(2):
                        self._body(bucket, splits, kv_host)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bucket, splits] = self._body(bucket, splits, kv_host)
                pool = graph.pool()
                self.graphs[bucket, splits] = graph
        torch.cuda.synchronize()
