"""Ranks 1.. of a tensor-parallel worker (docs/design.md §4.10): they hold their shard of the
model, their KV heads' pages and their end of every K/V pair, and do what rank 0 tells them,
in order (``TensorGroup.receive``): each forward (``Step``), and each K/V transfer operation
(``data_plane.MirroredTransport``). They schedule nothing and talk to nobody but their group.

A follower ends when rank 0 says so (``None``: shutdown), when rank 0 is gone (its sockets
close under every wait), when its parent is gone, or on any error: the front sees a rank's
process exit and declares the whole group dead.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import torch

from sangam.engine.kv_pool import KVPool
from sangam.engine.messages import Control
from sangam.engine.model_runner import ModelRunner
from sangam.engine.multi import data_plane
from sangam.engine.multi.kv_transfer import Done, KVTransport, layer_hook
from sangam.engine.multi.launcher import WorkerSpec
from sangam.engine.tensor_group import Step, TensorGroup, global_rank
from sangam.engine.worker import agree, build_worker_parts, worker_control
from sangam.engine.worker_control import WorkerControl
from sangam.models import PagedKV

_POLL_S = 0.001  # waiting for this rank's part of a receive rank 0 already has


class Follower:
    def __init__(self, runner: ModelRunner, group: TensorGroup, transport: KVTransport | None,
                 wait_s: float, control: WorkerControl):
        self.runner = runner
        self.control = control
        self.group = group
        self.transport = transport
        self.wait_s = wait_s  # the longest a receive's part may lag rank 0's
        self._received: dict[tuple[int, int], Done] = {}

    def serve(self) -> None:
        while (command := self.group.receive()) is not None:
            self._poll()
            if isinstance(command, Step):
                self._step(command)
            else:
                name, *args = command
                getattr(self, f"_{name}")(*args)

    def _step(self, step: Step) -> None:
        if not step.streams:
            self.runner.follow(step)
            return
        streams = [(dest, tid, self._page_ids(pages)) for dest, tid, pages in step.streams]

        def on_layer(layer: int) -> None:
            for dest, tid, page_ids in streams:
                self.transport.send_layers(dest, tid, page_ids, range(layer, layer + 1))

        with layer_hook(self.runner.loaded.model, on_layer):
            self.runner.follow(step)

    def _page_ids(self, pages: list[int]) -> torch.Tensor:
        return torch.tensor(pages, dtype=torch.int64).to(self.transport.device)

    def _control(self, m: Control) -> None:
        """Rank 0's ``Control``, on this rank's shard; then the ranks agree on its outcome
        (``worker.agree``: rank 0 ends the group if they differ)."""
        try:
            self.control.run(m)
            ok = True
        except Exception:
            ok = False
        agree(self.group, ok)

    # K/V transfer operations, as rank 0 made them (``MirroredTransport``).
    def _open_send(self, dest: int) -> None:
        self.transport.open_send(dest)  # ids are counted alike on every rank

    def _send_layers(self, dest: int, tid: int, pages: list[int], start: int,
                     stop: int) -> None:
        self.transport.send_layers(dest, tid, self._page_ids(pages), range(start, stop))

    def _close_send(self, dest: int, tid: int) -> None:
        self.transport.close_send(dest, tid)

    def _receive(self, src: int, tid: int, num_pages: int) -> None:
        self.transport.receive(src, tid, num_pages)

    def _peer_dead(self, peer: int) -> None:
        self.transport.peer_dead(peer)

    def _scatter_received(self, peer: int, tid: int, pages: list[int] | None) -> None:
        """Rank 0 took its part of a receive: take this rank's (waiting for it), into
        ``pages``, or drop it (None)."""
        deadline = time.monotonic() + self.wait_s
        while (peer, tid) not in self._received:
            if time.monotonic() > deadline:
                raise TimeoutError(f"this rank's part of K/V transfer {tid} from worker "
                                   f"{peer} did not arrive in {self.wait_s:.0f}s")
            time.sleep(_POLL_S)
            self._poll()
        done = self._received.pop((peer, tid))
        if pages is not None:
            if not done.ok:
                raise RuntimeError(f"this rank's part of K/V transfer {tid} from worker {peer} "
                                   f"failed ({done.error}) where rank 0's arrived")
            self.transport.scatter_received(done, pages)

    def _poll(self) -> None:
        if self.transport is None:
            return
        for d in self.transport.poll():
            if not d.is_send:
                self._received[(d.peer, d.transfer_id)] = d


def start_follower(spec: WorkerSpec) -> Follower:
    """Load this rank's shard, build its pool and runner, and join its group."""
    config, device, loaded = data_plane.load_rank(spec)

    def build(group: TensorGroup | None) -> tuple[tuple[KVPool, ModelRunner], PagedKV]:
        pool, _, runner = build_worker_parts(config, loaded, group)
        return (pool, runner), pool.kv

    (pool, runner), group, transport = data_plane.join(spec, device, build)
    rank = global_rank(spec.worker, spec.tp_rank, config.tensor_parallel_size)
    control = worker_control(config, loaded, pool, runner, None, rank)
    return Follower(runner, group, transport, config.transfer_timeout, control)


def run_follower(spec: WorkerSpec, parent_pid: int) -> None:
    """Entry point of a forked follower process. Never returns (os._exit, as a worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front shuts the group down

    def orphaned() -> None:  # the zygote (or node process) is gone: nobody would reap us
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True, name="sangam-orphan-watch").start()
    code = 0
    try:
        start_follower(spec).serve()
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)
