"""Deployment layout: which workers exist, their roles, nodes and devices, and how they start.

Workers are numbered globally: colocated ``0 .. num_workers-1``; disaggregated / hybrid the
prefill workers first, then the decode workers. A worker of ``--tensor-parallel-size N`` is
N processes (ranks). With ``nnodes`` nodes, node ``r`` runs the contiguous slice
``[r*k, (r+1)*k)`` of the workers, ``k = ceil(total / nnodes)``, each with all its ranks; with
fewer workers than nodes, of the processes (worker-major, then rank), so that a worker's ranks
span nodes. Node 0 also runs the front. The node's i-th process uses ``devices[i]`` when a
device list is given, else ``cuda:i`` on GPU or the CPU.

Processes: a node's workers are forked from one process that imported everything once (the
"zygote" on node 0, the node entry point elsewhere), which needs Linux (fork, pidfd).

Addresses: on one node everything binds to loopback on free ports. Across nodes,
``dist_init_addr = host:port`` is node 0's: the torch.distributed TCP store listens on ``port``
and the front's ZeroMQ socket on ``port + 1``; each node's data plane binds to the interface
``network.node_address`` chose.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sangam.config import EngineConfig
from sangam.engine.loaded_model import default_device
from sangam.engine.multi.network import NodeAddress
from sangam.models import ModelConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start (pickled to the zygote on node 0)."""

    worker: int
    roles: tuple[str, ...]
    config: EngineConfig
    device: str
    front_addr: str  # ZeroMQ endpoint of the front
    store_addr: tuple[str, int] | None  # torch.distributed TCP store; None: no K/V transfers
    num_threads: int  # torch intra-op threads (CPU): the host's cores shared among its workers
    tp_rank: int = 0  # its rank in its worker's tensor-parallel group (0: the worker itself)
    address: NodeAddress | None = None  # its node's data-plane interface (several nodes)


def signature(roles: tuple[str, ...], config: EngineConfig, model_config: ModelConfig) -> tuple:
    """What the front and every worker must agree on (checked at startup)."""
    return (config.mode, roles, config.page_size, config.tensor_parallel_size,
            config.enable_expert_parallel, model_config.num_layers, model_config.num_kv_heads,
            model_config.head_dim, model_config.vocab_size)


def node_processes(num_workers: int, tp: int, nnodes: int, node_rank: int
                   ) -> list[tuple[int, int]]:
    """(worker, tensor-parallel rank) of each process node ``node_rank`` runs, in order. With
    at least as many workers as nodes, whole workers (a worker's ranks share a node's fast
    links); with fewer, a worker's ranks span nodes (processes sliced the same way)."""
    if num_workers >= nnodes:
        k = math.ceil(num_workers / nnodes)
        workers = range(min(num_workers, node_rank * k), min(num_workers, (node_rank + 1) * k))
        return [(w, t) for w in workers for t in range(tp)]
    total = num_workers * tp
    k = math.ceil(total / nnodes)
    return [divmod(p, tp) for p in range(min(total, node_rank * k),
                                         min(total, (node_rank + 1) * k))]


def worker_device(config: EngineConfig, local_index: int) -> str:
    devices = config.device_list
    if devices:
        return devices[local_index]
    device = config.device or default_device()
    return f"cuda:{local_index}" if device == "cuda" else device


def needs_data_plane(config: EngineConfig) -> bool:
    """Whether the workers join a process group: to move K/V (colocated workers never do),
    or to split forwards across a worker's ranks."""
    return config.mode != "colocated" or config.tensor_parallel_size > 1


def validate(config: EngineConfig) -> list[str]:
    """The roles, after checking that the nodes and devices can host them; raises ValueError
    with what is wrong."""
    roles = list(config.deployment.roles)
    devices = config.device_list
    tp = config.tensor_parallel_size
    for r in range(config.nnodes):
        local = len(node_processes(len(roles), tp, config.nnodes, r))
        if not local:
            raise ValueError(f"node {r} would run no process: {len(roles)} workers of {tp} "
                             f"ranks cannot be spread over {config.nnodes} nodes (a node runs "
                             "whole workers when there are at least as many as nodes)")
        if devices and len(devices) < local:
            raise ValueError(f"node {r} runs {local} worker processes (tensor-parallel ranks "
                             f"included) but --devices lists {len(devices)}")
        # Two workers on one GPU would each size their KV pool to most of its memory, and
        # NCCL refuses two ranks on one GPU.
        gpus = [d for d in (worker_device(config, i) for i in range(local))
                if d.startswith("cuda")]
        if len(set(gpus)) < len(gpus):
            raise ValueError(f"node {r}'s {local} workers would share a GPU ({', '.join(gpus)})"
                             ": give each its own with --devices cuda:0,cuda:1,... or --device "
                             "cuda")
    return roles


def make_specs(config: EngineConfig, roles: list[str], node_rank: int, front_addr: str,
               store_addr: tuple[str, int] | None, address: NodeAddress | None = None
               ) -> list[WorkerSpec]:
    procs = node_processes(len(roles), config.tensor_parallel_size, config.nnodes, node_rank)
    threads = max(1, len(os.sched_getaffinity(0)) // max(1, len(procs)))
    return [WorkerSpec(w, tuple(roles), config, worker_device(config, i), front_addr,
                       store_addr, threads, t, address)
            for i, (w, t) in enumerate(procs)]


def fork_workers(specs: list[WorkerSpec], run_worker: Callable[[WorkerSpec, int], None]
                 ) -> list[int]:
    """Fork one worker per spec from this process, which imported what they need once; each
    child runs ``run_worker(spec, parent pid)``, which never returns. Returns their pids."""
    parent = os.getpid()
    pids = []
    for spec in specs:
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # stdout may be the launcher's pipe to the front: nobody reads it
            run_worker(spec, parent)  # never returns
        pids.append(pid)
    return pids


def supervise(live: set[int], front_pid: int | None = None) -> int:
    """Reap the forked workers ``live`` (removed as they exit, so that a signal handler may
    kill what is left) until none is left; 0 if all exited cleanly. When ``front_pid`` (this
    process's parent) is gone, kill them: nobody else would."""
    failed = False
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if front_pid is not None and os.getppid() != front_pid:
                kill_all(live)
            time.sleep(0.1)
            continue
        if pid in live:
            live.discard(pid)
            failed = failed or os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL our own children (not yet reaped, so their pids cannot have been reused)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class ProcessHandle:
    """A local worker process that is not our child (the zygote forked it): liveness and
    SIGKILL through a pidfd, which cannot be confused by pid reuse."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone

    def is_alive(self) -> bool:
        return self._fd is not None and not select.select([self._fd], [], [], 0)[0]

    def join(self, timeout: float) -> None:
        if self._fd is not None:
            select.select([self._fd], [], [], max(0.0, timeout))

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WorkerProcesses:
    """A worker's processes (its tensor-parallel ranks; one without) as one handle: alive
    while every rank is, since a group that lost a rank cannot compute."""

    def __init__(self, ranks: list[ProcessHandle]):
        self.ranks = ranks

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.ranks)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.ranks:
            p.join(deadline - time.monotonic())

    def kill(self) -> None:
        for p in self.ranks:
            p.kill()

    def close(self) -> None:
        for p in self.ranks:
            p.close()


def start_local_workers(specs: list[WorkerSpec]) -> tuple[subprocess.Popen, list[ProcessHandle]]:
    """Start this node's workers: ``python -m sangam.engine.multi.zygote`` imports everything
    once and forks them (much cheaper than one interpreter per worker, and unlike
    multiprocessing's spawn it never re-imports the user's ``__main__``, so scripts without a
    ``__main__`` guard work). Returns the zygote and a handle per process, in spec order."""
    zygote = subprocess.Popen([sys.executable, "-m", "sangam.engine.multi.zygote"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    zygote.stdin.write(pickle.dumps(specs))
    zygote.stdin.close()
    line = zygote.stdout.readline()  # the pids, once forked
    if not line:
        zygote.wait()
        raise RuntimeError(f"the worker launcher failed (exit code {zygote.returncode})")
    return zygote, [ProcessHandle(int(p)) for p in line.split()]


def group_by_worker(specs: list[WorkerSpec], handles: list[ProcessHandle]
                    ) -> dict[int, WorkerProcesses]:
    """``start_local_workers``' handles as one ``WorkerProcesses`` per worker."""
    ranks: dict[int, list[ProcessHandle]] = {}
    for spec, h in zip(specs, handles, strict=True):
        ranks.setdefault(spec.worker, []).append(h)
    return {w: WorkerProcesses(hs) for w, hs in ranks.items()}
