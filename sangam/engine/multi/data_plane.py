"""A worker process's torch.distributed side: joining the process group, its tensor-parallel
group (``engine/tensor_group.py``), its K/V transport (``kv_transfer.py``), and rank 0's
mirror of that transport for the other ranks of its group (``MirroredTransport``).

Every process of the deployment creates every group in one order: the default group (one
rank per GPU: worker ``w``'s rank ``t`` is ``w * tp + t``), then every worker's
tensor-parallel group, then (once its pool exists) every K/V pair.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from sangam.config import EngineConfig
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.multi.kv_transfer import Done, KVTransport
from sangam.engine.multi.launcher import WorkerSpec
from sangam.engine.tensor_group import TensorGroup, global_rank
from sangam.models import PagedKV, ShardLayout

STORE_TIMEOUT_S = 300  # joining the process group: every worker of every node must come up
SERVING_KEY = "sangam/serving"  # set in the store by the front once every worker is up
# NCCL: a wait blocks the waiting thread and raises on a timeout or an aborted communicator
# (a failed transfer), and a failed communicator is aborted without tearing the process down
# (the default would take a surviving worker down with its dead peer).
_NCCL_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

Parts = TypeVar("Parts")


def shard_layout(config: EngineConfig, tp_rank: int = 0) -> ShardLayout:
    """The slice of the model rank ``tp_rank`` of a worker holds under ``config``."""
    return ShardLayout(tp_rank, config.tensor_parallel_size, config.enable_expert_parallel)


def load_rank(spec: WorkerSpec) -> tuple[EngineConfig, torch.device, LoadedModel]:
    """A worker process's start (every rank's): the engine config for its device, the device
    made current (or its share of the host's threads), and its shard of the model."""
    config = dataclasses.replace(spec.config, device=spec.device, devices=None)
    device = torch.device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(spec.num_threads)
    else:
        torch.cuda.set_device(device)
    return config, device, LoadedModel.load(config, shard_layout(config, spec.tp_rank))


def join(spec: WorkerSpec, device: torch.device,
         build: Callable[[TensorGroup | None], tuple[Parts, PagedKV]]
         ) -> tuple[Parts, TensorGroup | None, KVTransport | None]:
    """Join the deployment's process group (when it has one), build this rank's parts with
    ``build(group)`` (which returns them and their KV pool's pages), and connect its K/V
    transport (disaggregated and hybrid modes)."""
    config = spec.config
    if spec.store_addr is None:
        parts, _ = build(None)
        return parts, None, None
    tp = config.tensor_parallel_size
    host, port = spec.store_addr
    startup = datetime.timedelta(seconds=STORE_TIMEOUT_S)
    store = dist.TCPStore(host, port, is_master=False, timeout=startup)
    if device.type == "cuda":
        os.environ.update(_NCCL_ENV)  # read when the process groups are created
    if spec.address is not None:  # several nodes: never the hostname's (loopback) address
        os.environ.update(spec.address.environment(device.type))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=store,
        rank=global_rank(spec.worker, spec.tp_rank, tp), world_size=len(spec.roles) * tp,
        timeout=startup, device_id=device if device.type == "cuda" else None)
    group = None
    if tp > 1:
        group = TensorGroup(spec.worker, shard_layout(config, spec.tp_rank), len(spec.roles),
                            device,
                            datetime.timedelta(seconds=config.transfer_timeout))
    parts, kv = build(group)
    transport = None
    if config.mode != "colocated":
        transport = KVTransport(kv, config.transfer_buffer_bytes,
                                config.watchdog_timeout)
        transport.connect(spec.worker, _ranks(spec.roles, "prefill"),
                          _ranks(spec.roles, "decode"), config.transfer_timeout,
                          spec.tp_rank, tp)
    return parts, group, transport


def _ranks(roles: tuple[str, ...], role: str) -> list[int]:
    return [i for i, r in enumerate(roles) if r == role]


class MirroredTransport:
    """Rank 0's K/V transport under tensor parallelism: every operation is first handed to the
    other ranks of the group (``TensorGroup.send``), which replay it on their own transports,
    in the same order, with the same ranks of the peer's group: each rank moves its own KV
    heads. Rank 0 alone decides (polls, budgets, failures); a follower whose part of a
    transfer rank 0 found good failed cannot keep its shard whole, and ends the group."""

    def __init__(self, inner: KVTransport, group: TensorGroup):
        self.inner = inner
        self.group = group

    # What rank 0 alone reads.
    @property
    def local(self) -> KVTransport:
        return self.inner

    @property
    def num_open(self) -> int:
        return self.inner.num_open

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def sends_throttled(self) -> bool:
        return self.inner.sends_throttled()

    def poll(self) -> list[Done]:
        return self.inner.poll()

    # What every rank does.
    def open_send(self, dest: int) -> int:
        self.group.send(("open_send", dest))
        return self.inner.open_send(dest)

    def send_layers(self, dest: int, transfer_id: int, pages: torch.Tensor,
                    layers: range) -> None:
        self.group.send(("send_layers", dest, transfer_id, pages.tolist(), layers.start,
                         layers.stop))
        self.inner.send_layers(dest, transfer_id, pages, layers)

    def close_send(self, dest: int, transfer_id: int) -> tuple[int, bool]:
        self.group.send(("close_send", dest, transfer_id))
        return self.inner.close_send(dest, transfer_id)

    def receive(self, src: int, transfer_id: int, num_pages: int) -> None:
        self.group.send(("receive", src, transfer_id, num_pages))
        self.inner.receive(src, transfer_id, num_pages)

    def scatter_received(self, done: Done, pages: list[int] | None) -> None:
        self.group.send(("scatter_received", done.peer, done.transfer_id, pages))
        self.inner.scatter_received(done, pages)

    def peer_dead(self, peer: int) -> None:
        self.group.send(("peer_dead", peer))
        self.inner.peer_dead(peer)
