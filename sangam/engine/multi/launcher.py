"""Deployment layout: which workers exist, their roles, nodes and devices, and how they start.

Workers are numbered globally: colocated ``0 .. num_workers-1``; disaggregated / hybrid the
prefill workers first, then the decode workers. With ``nnodes`` nodes, node ``r`` runs the
contiguous slice ``[r*k, (r+1)*k)`` with ``k = ceil(total / nnodes)``; node 0 also runs the
front. A node's i-th worker uses ``devices[i]`` when a device list is given, else ``cuda:i``
on GPU or the CPU.

Addresses: on one node everything binds to loopback on free ports. Across nodes,
``dist_init_addr = host:port`` is node 0's: the torch.distributed TCP store listens on ``port``
and the front's ZeroMQ socket on ``port + 1``.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass

from sangam.config import EngineConfig
from sangam.engine.loaded_model import default_device


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start; pickled to it by the spawn context."""

    worker: int
    roles: tuple[str, ...]
    config: EngineConfig
    device: str
    front_addr: str  # ZeroMQ endpoint of the front
    store_addr: tuple[str, int] | None  # torch.distributed TCP store; None: no K/V transfers
    parent_pid: int  # the worker exits when this process is gone
    num_threads: int  # torch intra-op threads (CPU): the host's cores shared among its workers


def signature(roles: tuple[str, ...], config: EngineConfig, model_config) -> tuple:
    """What the front and every worker must agree on (checked at startup)."""
    return (config.mode, roles, config.page_size, model_config.num_layers,
            model_config.num_kv_heads, model_config.head_dim, model_config.vocab_size)


def device_list(config: EngineConfig) -> list[str]:
    return [d.strip() for d in config.devices.split(",") if d.strip()] if config.devices else []


def worker_roles(config: EngineConfig) -> list[str]:
    if config.mode == "colocated":
        n = config.num_workers
        if n == 1 and config.nnodes == 1 and len(device_list(config)) > 1:
            n = len(device_list(config))  # "--devices cuda:0,cuda:1" alone means two workers
        return ["colocated"] * n
    return ["prefill"] * config.prefill_workers + ["decode"] * config.decode_workers


def node_workers(num_workers: int, nnodes: int, node_rank: int) -> range:
    k = math.ceil(num_workers / nnodes)
    return range(min(num_workers, node_rank * k), min(num_workers, (node_rank + 1) * k))


def worker_device(config: EngineConfig, local_index: int) -> str:
    devices = device_list(config)
    if devices:
        return devices[local_index]
    device = config.device or default_device()
    return f"cuda:{local_index}" if device == "cuda" else device


def needs_data_plane(config: EngineConfig) -> bool:
    """Colocated workers never move K/V: they join no process group."""
    return config.mode != "colocated"


def validate(config: EngineConfig) -> list[str]:
    """The roles, after checking the layout; raises ValueError with what is wrong."""
    roles = worker_roles(config)
    if config.mode != "colocated" and config.policy == "fastdllm":
        raise ValueError("the fastdllm policy (batch size 1) has no disaggregated form: use "
                         "mode='colocated'")
    if len(roles) < config.nnodes:
        raise ValueError(f"{len(roles)} workers cannot span {config.nnodes} nodes")
    devices = device_list(config)
    for r in range(config.nnodes):
        local = len(node_workers(len(roles), config.nnodes, r))
        if devices and len(devices) < local:
            raise ValueError(f"node {r} runs {local} workers but --devices lists "
                             f"{len(devices)}")
    return roles


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host, int(port)


def make_specs(config: EngineConfig, roles: list[str], node_rank: int, front_addr: str,
               store_addr: tuple[str, int] | None) -> list[WorkerSpec]:
    workers = node_workers(len(roles), config.nnodes, node_rank)
    threads = max(1, (os.cpu_count() or 1) // max(1, len(workers)))
    return [WorkerSpec(w, tuple(roles), config, worker_device(config, i), front_addr,
                       store_addr, os.getpid(), threads)
            for i, w in enumerate(workers)]


class WorkerProcess:
    """A worker started as ``python -m sangam.engine.multi.worker`` with its spec on stdin.

    Not multiprocessing's spawn: that re-imports the parent's ``__main__``, so a user script
    without an ``if __name__ == "__main__":`` guard would start engines recursively. Workers
    outlive nobody: the front stops them on shutdown and at exit, and each worker exits by
    itself when its parent disappears (see ``worker._watchdog``).
    """

    def __init__(self, spec: WorkerSpec):
        self.worker = spec.worker
        self._popen = subprocess.Popen([sys.executable, "-m", "sangam.engine.multi.worker"],
                                       stdin=subprocess.PIPE)
        self._popen.stdin.write(pickle.dumps(spec))
        self._popen.stdin.close()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL if still running; does not wait (safe in a signal handler)."""
        self._popen.send_signal(signal.SIGKILL)


def spawn(specs: list[WorkerSpec]) -> list[WorkerProcess]:
    return [WorkerProcess(spec) for spec in specs]
