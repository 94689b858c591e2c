"""The process group between a trainer and the engine's ranks for weight updates
(docs/design.md §3.1; SGLang's ``init_weights_update_group``): rank 0 is the trainer, which
broadcasts each tensor; the engine's processes are ranks ``rank_offset`` onwards, each taking
its own cut of what it receives.

It is a group of its own, apart from any group the engine's workers already share (their K/V
transfers and tensor-parallel collectives): its own store, its own ranks. The trainer builds
the same object with ``rank=0``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
# How long every rank waits for the others to join, and for each broadcast.
JOIN_TIMEOUT = datetime.timedelta(seconds=300)


class WeightUpdateGroup:
    """One rank of a weight-update group. ``backend``: gloo (CPU tensors) or nccl (GPU
    tensors on ``device``)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str = "weight_update_group", backend: str = "gloo",
                 device: torch.device | str = "cpu",
                 timeout: datetime.timedelta = JOIN_TIMEOUT):
        check_group(master_address, master_port, rank, world_size, group_name, backend)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        self.store = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``tensor`` from rank ``src`` into every rank's ``tensor`` (in place)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.group.broadcast([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        """Leave the group (its store and communicators are released)."""
        self.group = None
        self.store = None


def check_group(master_address: str, master_port: int, rank: int, world_size: int,
                group_name: str, backend: str) -> None:
    """Bound every value a weight-update group is built from (docs/design.md §8)."""
    if not isinstance(master_address, str) or not master_address:
        raise ValueError("master_address must be a host name or address")
    if not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be an integer in [1, 65535], got {master_port!r}")
    if not isinstance(world_size, int) or not 2 <= world_size <= 65536:
        raise ValueError(f"world_size must be an integer in [2, 65536], got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, world_size), got {rank!r}")
    if not isinstance(group_name, str) or not group_name:
        raise ValueError("group_name must be a non-empty string")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
