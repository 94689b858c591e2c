"""What one rank does when the front asks for more than requests (docs/design.md §3.1, RL
rollouts): take new weights in place (from tensors, a checkpoint on disk, or a trainer's
broadcast), flush its prefix cache, and give its memory back and take it again.

Every rank of every worker runs the same operation (a tensor-parallel worker's rank 0 hands it
to its other ranks first), always between iterations and with no request in flight: the front
waits for that. The front has checked the update's names, shapes and dtypes; values are
checked here, by every rank alike, before anything is copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sangam.engine.kv_pool import KVPool
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.messages import Control
from sangam.engine.weight_group import WeightUpdateGroup
from sangam.models.weight_update import apply_update, parse_dtype, read_checkpoint
from sangam.sched.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

# What release_memory_occupation / resume_memory_occupation may name (SGLang's tags).
MEMORY_TAGS = ("kv_cache", "weights")


CONTROL_OPS = ("update_tensors", "update_disk", "join_group", "update_distributed",
               "flush_cache", "release", "resume")


class _Released:
    """Storages emptied in place and their bytes kept on the host: every tensor viewing them
    (a parameter, the experts' stacked views, a pool's layer views) keeps its object, and
    regains its values when they are restored."""

    def __init__(self, tensors: list[torch.Tensor], keep: bool):
        self.saved: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        seen = set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            n = storage.nbytes()
            host = None
            if keep:  # its bytes, off the device (pinned on a GPU: the copy back is fast)
                host = torch.empty(n, dtype=torch.uint8, pin_memory=storage.is_cuda)
                host.copy_(_bytes(storage))
            self.saved.append((storage, n, host))
        for storage, _, _ in self.saved:
            storage.resize_(0)

    def restore(self) -> None:
        """Bytes kept come back; others come back zeroed (a hybrid pool's ring may read a slot
        nothing wrote, under a zero weight: it must hold a finite value)."""
        for storage, n, host in self.saved:
            storage.resize_(n)
            if host is not None:
                _bytes(storage).copy_(host)
            else:
                _bytes(storage).zero_()
        self.saved = []


def _own_storages(model: torch.nn.Module) -> None:
    """Give each parameter read straight from a checkpoint file (a CPU tensor over the file's
    bytes, whose storage cannot be resized) storage of its own, once."""
    for t in [*model.parameters(), *model.buffers()]:
        if not t.untyped_storage().resizable():
            t.data = t.data.clone()


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class WorkerControl:
    """A rank's side of the operations. ``engine_rank``: this process's index among the
    engine's ranks (a worker's ranks are consecutive), its place in a weight-update group;
    ``recapture``: re-records its CUDA graphs (their addresses change when memory returns)."""

    def __init__(self, loaded: LoadedModel, pool: KVPool, cache: PrefixCache | None,
                 engine_rank: int, recapture: Callable[[], None] = lambda: None):
        self.loaded = loaded
        self.pool = pool
        self.cache = cache
        self.engine_rank = engine_rank
        self.recapture = recapture
        self.group: WeightUpdateGroup | None = None
        self.released: dict[str, _Released] = {}

    def run(self, control: Control) -> None:
        if control.op not in CONTROL_OPS:
            raise ValueError(f"unknown operation {control.op!r}")
        getattr(self, control.op)(*control.args)

    # Weights.
    def update_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self._apply(named)

    def update_disk(self, path: str, names: list[str]) -> None:
        self._apply(read_checkpoint(path, names))

    def join_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:
        if self.group is not None:
            self.group.close()
        self.group = WeightUpdateGroup(master_address, master_port,
                                       rank_offset + self.engine_rank, world_size, group_name,
                                       backend, self._group_device(backend))

    def update_distributed(self, specs: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Receive each tensor of ``specs`` from the trainer (rank 0), in order, then apply
        them all (a refused update changes nothing)."""
        if self.group is None:
            raise RuntimeError("no weight-update group: call init_weights_update_group first")
        named = []
        for name, shape, dtype in specs:
            t = torch.empty(shape, dtype=parse_dtype(dtype), device=self.group.device)
            named.append((name, self.group.broadcast(t)))
        self._apply(named)

    def _apply(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self.released:
            raise RuntimeError("the weights are released: resume_memory_occupation first")
        apply_update(self.loaded.model, named)
        self.flush_cache()  # its pages hold K/V of the old weights

    def _group_device(self, backend: str) -> torch.device:
        if backend == "nccl" and self.loaded.device.type != "cuda":
            raise ValueError("backend nccl needs the engine on a GPU; use gloo")
        return self.loaded.device if backend == "nccl" else torch.device("cpu")

    # The prefix cache.
    def flush_cache(self) -> None:
        if self.cache is not None:
            self.cache.clear()

    # Memory.
    def release(self, tags: tuple[str, ...]) -> None:
        """Empty the storages of ``tags``: the KV pool (its pages' contents are dropped, and
        the prefix cache with them) and the weights (kept on the host, restored by
        ``resume``)."""
        for tag in tags:
            if tag in self.released:
                continue
            if tag == "kv_cache":
                self.flush_cache()
                self.released[tag] = _Released(self.pool.kv.buffers, keep=False)
            else:
                model = self.loaded.model
                _own_storages(model)
                self.released[tag] = _Released(list(model.state_dict().values()), keep=True)
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, for a colocated trainer

    def resume(self, tags: tuple[str, ...]) -> None:
        resumed = [tag for tag in tags if tag in self.released]
        for tag in resumed:
            self.released.pop(tag).restore()
        if resumed:
            self.recapture()
