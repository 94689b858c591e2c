"""A worker's tensor-parallel group (docs/design.md §4.10): its ranks, their collectives, and
what rank 0 tells the others.

Rank 0 is the worker: scheduler, page allocator, host batch, commits. Before every forward it
broadcasts the forward's host arrays (``Step``: the arrays the device reads, not Python
objects), and before every K/V transfer operation the operation (``MirroredTransport`` in
``multi/data_plane.py``); the other ranks (``multi/follower.py``) replay them in order on their
own shard, pool and transport. Inside the forward the ranks meet in the model's all-reduces
and in the vocabulary-parallel scoring's all-gather (``scoring.ShardScorer``).

Host commands travel over a gloo group (CPU tensors); the model's collectives over the
device's backend (NCCL on GPU, the same gloo group on CPU).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from sangam.models.sharding import ShardLayout

# A follower waits for rank 0's next command for as long as the worker is idle; rank 0's
# death ends the wait at once (its sockets close), so this only bounds a wedged rank 0.
COMMAND_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class Step:
    """One forward, as the followers need it: the uploaded arrays by name (the same
    ``BatchUploader`` input rank 0 uses), the CUDA graph runner rank 0 picked (-1: eager), and
    the K/V transfers streamed layer by layer during it, as (dest, transfer id, pages)."""

    arrays: dict[str, np.ndarray]
    graph: int = -1
    streams: list[tuple[int, int, list[int]]] = field(default_factory=list)


def global_rank(worker: int, tp_rank: int, tp_size: int) -> int:
    """The torch.distributed rank of ``worker``'s rank ``tp_rank``: a worker's ranks are
    consecutive."""
    return worker * tp_size + tp_rank


class TensorGroup:
    """This process's view of its worker's group of ``size`` ranks."""

    def __init__(self, worker: int, layout: ShardLayout, num_workers: int,
                 device: torch.device, timeout: datetime.timedelta):
        """Create every worker's groups (every process must create every group, in one order)
        and keep this worker's."""
        self.layout = layout
        size = layout.size
        for w in range(num_workers):
            ranks = [global_rank(w, t, size) for t in range(size)]
            control = dist.new_group(ranks, backend="gloo", timeout=COMMAND_TIMEOUT)
            model = (dist.new_group(ranks, backend="nccl", timeout=timeout)
                     if device.type == "cuda" else control)
            if w == worker:
                self.ranks, self.control, self.model_group = ranks, control, model
        # Open the communicator now: NCCL opens it at its first collective, which must not be
        # inside a CUDA graph capture (the graphs are captured after this, per rank).
        dist.all_reduce(torch.zeros(1, device=device), group=self.model_group)

    @property
    def size(self) -> int:
        return self.layout.size

    # Host commands (rank 0 -> the others).
    def send(self, command: object) -> None:
        """Rank 0: hand ``command`` to every other rank (they ``receive`` it in order)."""
        dist.broadcast_object_list([command], src=self.ranks[0], group=self.control)

    def receive(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.control)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The least of every rank's ``value`` (the KV pool's pages: the tightest GPU's)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # The model's collectives.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` across the ranks, in place (``DiffusionLM.all_reduce``)."""
        dist.all_reduce(x, group=self.model_group)
        return x

    def all_gather_model(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x``, concatenated along the first dimension in rank order (the
        vocabulary-parallel scoring's five numbers a row: ``scoring.ShardScorer``)."""
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shards, x, group=self.model_group)
        return torch.cat(shards)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The whole vocabulary of these logits rows ``[R, V]`` (every rank gets it), for the
        few rows whose scoring reads every token (rescoring, structured output)."""
        width = -(-vocab_size // self.size)
        mine = torch.zeros(logits.shape[0], width, dtype=logits.dtype, device=logits.device)
        mine[:, :logits.shape[1]] = logits
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.model_group)
        return torch.cat(parts, dim=1)[:, :vocab_size]
