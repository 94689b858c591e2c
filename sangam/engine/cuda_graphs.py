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

Block-causal models (SDAR, LLaDA2; ``causal_block`` B): a block's first step spans 2B (it
stores the finished block's final K/V), its later steps B, so a batch mixes the two. Two
runners serve a block length: span B takes batches of later steps only, and span 2B takes
every batch of spans B and 2B, a B-span request padded to 2B rows whose first B are dummies
(position 0, slot -1: they store nothing, nothing reads them, and the real rows attend over the
cache alone, as eagerly). The eager plan of such a batch has the same tiles (its longest span
is 2B) and the runner forces the eager split count, which counts the real tokens. The graph
also holds each request's block size and each row's position (the block-causal mask's inputs);
its output rows are gathered back to the batch's packed order.

Uniform-state models (DiffusionGemma; ``canvas``): a canvas's later steps span its C
positions, every row a decoder row, so a runner of span C takes batches of them alone (a
canvas's first step holds encoder rows too and runs eagerly). The graph also holds each row's
key bounds, its self-conditioning (``[rows, hidden]``, the step's input beside the tokens) and,
under a hybrid pool, the sliding layers' ring tables and slots; padding rows see no key. Its
two layer shapes plan their KV splits apart, so its split "count" is a pair (full layers',
sliding layers'), and the pairs captured per bucket are those its batches reach over a grid
of KV lengths (a batch whose pair was not captured runs eagerly).
"""

from __future__ import annotations

import numpy as np
import torch

from sangam.engine.host_batch import PackedBatch
from sangam.kernels.paged_attention import kv_splits
from sangam.models.attention import AttentionMetadata, PagedKV
from sangam.models.diffusion_gemma import CanvasRows
from sangam.models.transformer import DiffusionLM

Splits = int | tuple[int, int]  # one count, or DiffusionGemma's (full layers', sliding')


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch_size``
    (which is always included), as vLLM does — padding wastes at most 15 requests' work."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return [*sizes, max_batch_size]


class DecodeGraphRunner:
    """Runs :meth:`DiffusionLM.hidden_states` for uniform-span batches from static buffers,
    replaying a CUDA graph per (batch-size bucket, KV split count) (``use_graphs``) or
    eagerly; for a block-causal model (``causal_block``), span B or 2B (see the module
    docstring)."""

    def __init__(self, model: DiffusionLM, kv: PagedKV, span: int, max_batch_size: int,
                 max_pages: int, device: torch.device, use_graphs: bool = True,
                 causal_block: int | None = None, canvas: bool = False,
                 rings: bool = False):
        """``canvas``: a uniform-state model's canvas steps (``span``: its canvas length);
        ``rings``: its pool is a hybrid one (the sliding layers' tables are inputs too)."""
        if causal_block is not None and span not in (causal_block, 2 * causal_block):
            raise ValueError(f"a block-causal decode span is B or 2B, got {span} for B = "
                             f"{causal_block}")
        self.model = model
        self.kv = kv
        self.span = span
        self.causal_block = causal_block
        # 2B: takes B-span requests too, each padded with B dummy rows in front.
        self.padded = causal_block is not None and span == 2 * causal_block
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_pages = max_pages
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.runs = 0  # batches served from the static buffers (observability, tests)
        # Each bucket's split counts: every power of two up to its smallest batch's count at
        # the longest context (kv_splits is monotone in both): the fewest real tokens, which a
        # padded runner's batches have with one 2B span and the rest B.
        longest = max_pages * kv.page_size
        self.canvas = canvas
        self.split_counts: dict[int, list[Splits]] = {}
        for smallest, bucket in zip([1, *(b + 1 for b in self.sizes)], self.sizes):
            if canvas:
                self.split_counts[bucket] = self._reached(smallest, bucket, longest)
                continue
            fewest = smallest * causal_block + causal_block if self.padded \
                else smallest * span
            top = self.kv_splits(fewest, longest)
            self.split_counts[bucket] = [1 << i for i in range(top.bit_length())]
        most, n = self.sizes[-1], self.sizes[-1] * span
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens_q = torch.arange(0, n + 1, span, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(most, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(most, max_pages, dtype=torch.int32, device=device)
        self.causal_blocks = None if causal_block is None else torch.full(
            (most,), causal_block, dtype=torch.int32, device=device)
        if canvas:  # each row's keys, its self-conditioning, and the rows (all decoder rows)
            self.key_lo = torch.zeros(n, dtype=torch.int32, device=device)
            self.key_hi = torch.zeros(n, dtype=torch.int32, device=device)
            self.window_lo = torch.zeros(n, dtype=torch.int32, device=device)
            self.soft = torch.zeros(n, model.config.hidden_size, device=device,
                                    dtype=model.output_head().weight.dtype)
            self.rows = torch.arange(n, device=device)
        self.window_tables = self.window_slots = None
        if rings:
            self.window_tables = torch.zeros(most, max_pages, dtype=torch.int32, device=device)
            self.window_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, Splits], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, Splits], torch.Tensor] = {}
        if use_graphs:
            self._capture()

    def kv_splits(self, num_tokens: int, max_kv_len: int) -> Splits:
        """The KV split count the eager forward plans for ``num_tokens`` query tokens in spans
        of at most ``span``, whose longest KV length is ``max_kv_len`` (DiffusionGemma: each
        layer shape's, full layers' first)."""
        cfg = self.model.config
        dtype = self.kv.buffers[0].dtype
        counts = tuple(kv_splits(num_tokens, self.span, max_kv_len, cfg.num_heads, heads, d,
                                 dtype, self.device) for heads, d in _layer_shapes(cfg))
        return counts if len(counts) > 1 else counts[0]

    def _reached(self, smallest: int, bucket: int, longest: int) -> list[Splits]:
        """The split counts a bucket's batches reach: every request count it takes, over KV
        lengths at eight points an octave up to the longest."""
        lengths = sorted({max(1, min(longest, int(2 ** (i / 8)))) for i in
                          range(8 * longest.bit_length() + 1)})
        return sorted({self.kv_splits(n * self.span, kv) for n in range(smallest, bucket + 1)
                       for kv in lengths})

    def graph_key(self, batch: PackedBatch) -> tuple[int, Splits]:
        """(bucket, split count) of the graph that runs ``batch``."""
        n = len(batch.kv_lens)
        bucket = next(b for b in self.sizes if b >= n)
        return bucket, self.kv_splits(len(batch.input_ids), int(batch.kv_lens.max()))

    def can_run(self, batch: PackedBatch, block_length: int | None = None) -> bool:
        """Whether a graph of this runner computes ``batch``: its spans fit (``span``; for a
        padded runner, B or 2B with at least one 2B) and, for a block-causal model, all its
        requests have this block length (``block_length``: theirs if they share one)."""
        n = len(batch.kv_lens)
        if not (0 < n <= self.sizes[-1] and batch.block_tables.shape[1] <= self.max_pages
                and block_length == self.causal_block):
            return False
        if self.canvas and batch.num_rows != len(batch.input_ids):
            return False  # a canvas's first step: encoder rows too
        spans = np.diff(batch.cu_seqlens_q)
        if self.padded:
            fits = bool((spans == self.span).any() and ((spans == self.span)
                                                       | (spans == self.causal_block)).all())
        else:
            fits = bool((spans == self.span).all())
        if not fits:
            return False
        bucket, splits = self.graph_key(batch)
        return splits in self.split_counts[bucket]

    def run(self, batch: PackedBatch, dev: dict[str, torch.Tensor],
            canvas: CanvasRows | None = None) -> torch.Tensor:
        """Hidden states ``[N, hidden]`` of the batch's N query rows, from ``dev``, its uploaded
        ``device_arrays()`` (and a canvas runner's ``canvas``: the rows' self-conditioning).
        With graphs, a view of the graph's output buffer: valid until the next call."""
        n = len(batch.kv_lens)
        bucket, splits = key = self.graph_key(batch)
        rows, width = n * self.span, batch.block_tables.shape[1]
        real = None  # where the real rows are (None: the first ``rows``, in order)
        if self.padded:
            real = self._real_rows(dev["cu_seqlens_q"], len(batch.input_ids))
            self.input_ids[:rows].zero_()
            self.positions[:rows].zero_()
            self.slot_mapping[:rows].fill_(-1)
            self.input_ids.index_copy_(0, real, dev["input_ids"])
            self.positions.index_copy_(0, real, dev["positions"])
            self.slot_mapping.index_copy_(0, real, dev["slot_mapping"])
        else:
            self.input_ids[:rows].copy_(dev["input_ids"])
            self.positions[:rows].copy_(dev["positions"])
            self.slot_mapping[:rows].copy_(dev["slot_mapping"])
        self.kv_lens[:n].copy_(dev["kv_lens"])
        if n < bucket:  # padding requests: store nothing, attend to nothing
            self.slot_mapping[rows:bucket * self.span].fill_(-1)
            self.kv_lens[n:bucket].zero_()
        self.block_tables[:n, :width].copy_(dev["block_tables"])
        if self.canvas:  # padding rows see no key
            for buf, name in ((self.key_lo, "key_lo"), (self.key_hi, "key_hi"),
                              (self.window_lo, "window_lo")):
                buf[:rows].copy_(dev[name])
                buf[rows:].zero_()
            self.soft[:rows].copy_(canvas.soft)
        if self.window_tables is not None:
            self.window_tables[:n, :width].copy_(dev["window_block_tables"])
            self.window_slots[:rows].copy_(dev["window_slot_mapping"])
            self.window_slots[rows:].fill_(-1)
        self.runs += 1
        if self.use_graphs:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self._body(bucket, splits, [*batch.kv_lens.tolist(), *[0] * (bucket - n)])
        return out[:rows] if real is None else out[real]

    def _real_rows(self, cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The padded rows holding the batch's ``num_tokens`` real ones, in packed order:
        request i's span ends its 2B rows. Device ops only (no sync)."""
        cu = cu_seqlens_q.long()
        lens = cu[1:] - cu[:-1]
        n = len(lens)
        ends = torch.arange(1, n + 1, device=cu.device) * self.span
        shift = torch.repeat_interleave(ends - cu[1:], lens, output_size=num_tokens)
        return torch.arange(num_tokens, device=cu.device) + shift

    def _body(self, bucket: int, splits: Splits, kv_lens_host: list[int]) -> torch.Tensor:
        rows = bucket * self.span
        causal = self.causal_blocks is not None
        rings = self.window_tables is not None
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:bucket + 1], kv_lens=self.kv_lens[:bucket],
            block_tables=self.block_tables[:bucket], slot_mapping=self.slot_mapping[:rows],
            query_lens=[self.span] * bucket, kv_lens_host=kv_lens_host, num_kv_splits=splits,
            causal_blocks=self.causal_blocks[:bucket] if causal else None,
            positions=self.positions[:rows] if causal else None,
            window_block_tables=self.window_tables[:bucket] if rings else None,
            window_slot_mapping=self.window_slots[:rows] if rings else None)
        extra = {}
        if self.canvas:
            meta.key_lo, meta.key_hi = self.key_lo[:rows], self.key_hi[:rows]
            meta.window_lo = self.window_lo[:rows]
            extra["canvas"] = CanvasRows(self.rows[:rows], self.soft[:rows])
        return self.model.hidden_states(self.input_ids[:rows], self.positions[:rows], meta,
                                        self.kv, **extra)

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


def _layer_shapes(cfg) -> list[tuple[int, int]]:
    """(KV heads, head_dim) of each layer shape: one, or DiffusionGemma's full layers' and its
    sliding layers' (in ``AttentionMetadata.kv_splits``' order)."""
    if cfg.gemma is None:
        return [(cfg.num_kv_heads, cfg.head_dim)]
    return [(cfg.gemma.full_kv_heads, cfg.gemma.full_head_dim), (cfg.num_kv_heads, cfg.head_dim)]
