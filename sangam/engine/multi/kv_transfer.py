"""K/V transfer between workers: torch.distributed point-to-point (docs/design.md §4, KV transfer).

One transfer moves one request's pages, every layer, K and V. Per layer ``l`` the sender gathers
layer ``l`` of the request's pages into a contiguous buffer ``[2, n, page_size, Hkv, D]`` (the
page kernel; its PyTorch reference on CPU) and posts a send; the receiver posts a receive of the
same shape per layer and, once all arrived, scatters them into its own pages (page ids differ
between the two pools). NCCL carries it on GPU, gloo on CPU.

Sends and receives between two workers match in the order they are posted: NCCL ignores tags,
so none are used, and gloo then matches the same way (the CPU tests check the rule NCCL
needs). A sender therefore posts all layers of a transfer before the next transfer to the same
receiver, and the receiver posts its receives in the order the front relays the transfers,
which is the order the sender reported them. ``connect`` opens every sender-receiver pair at
startup: NCCL opens a pair's communicator at its first send or receive, blocking until both
ends take part, and the receiver of a first transfer only posts once the sender reported it.

Completion is never polled from the worker loop directly: gloo's ``Work.is_completed()`` stays
False until ``wait()`` is called, and a ``wait`` with a timeout tears the connection down. So a
daemon thread waits on each transfer's works and reports into a queue the loop drains. A send
to a peer that dies fails in that thread (gloo closes the pair), so nothing hangs; transfers
with a peer known dead are refused up front.

Layer-wise streaming: ``LayerHook`` wraps the attention backend for one forward and calls back
after each layer's attention, by which time that layer's K/V of every span is in its pages, so
the sender posts layer ``l`` while layer ``l + 1`` computes.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sangam.models import AttentionBackend, AttentionMetadata


def layer_page_bytes(kv_buffer: torch.Tensor) -> int:
    """Bytes of one page of one layer's K (or V): ``page_size * Hkv * D * element size``."""
    return kv_buffer[0, 0, 0].numel() * kv_buffer.element_size()


def _page_ops(device: torch.device):
    """The page gather/scatter kernels: Triton on GPU, their PyTorch references on CPU."""
    if device.type == "cuda":
        from sangam.kernels.page_copy import gather_pages, scatter_pages

        return gather_pages, scatter_pages
    from sangam.kernels.reference import gather_pages_ref, scatter_pages_ref

    return gather_pages_ref, scatter_pages_ref


class LayerHook(AttentionBackend):
    """An attention backend that calls ``on_layer(i)`` after layer ``i``'s attention. It bears
    the inner backend's name: the model picks its other kernels (MoE) by it."""

    def __init__(self, inner: AttentionBackend, on_layer: Callable[[int], None]):
        self.inner = inner
        self.name = inner.name
        self.on_layer = on_layer
        self.layer = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = self.inner.forward(q, k, v, k_pages, v_pages, meta, scale)
        self.on_layer(self.layer)
        self.layer += 1
        return out


@dataclass
class Done:
    """A transfer finished (``ok``) or failed (``error``)."""

    transfer_id: int
    peer: int
    is_send: bool
    ok: bool
    nbytes: int
    buffer: torch.Tensor | None  # a receive's data, [L, 2, n, page_size, Hkv, D]
    error: str | None = None


@dataclass
class _Transfer:
    transfer_id: int
    peer: int
    is_send: bool
    buffers: list[torch.Tensor] = field(default_factory=list)  # kept alive until completion
    works: list = field(default_factory=list)
    nbytes: int = 0
    error: str | None = None  # a post failed: reported when the transfer closes


class KVTransport:
    """One worker's end of the data plane. Called from the worker loop only; waiter threads
    touch nothing but their transfer's works and the completion queue."""

    def __init__(self, kv_buffer: torch.Tensor):
        self.kv_buffer = kv_buffer
        self.device = kv_buffer.device
        self.num_layers = kv_buffer.shape[0]
        self.gather, self.scatter = _page_ops(self.device)
        self._ids = itertools.count()
        self._open: dict[tuple[int, int, bool], _Transfer] = {}  # (peer, id, is_send)
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._dead: set[int] = set()

    @property
    def num_open(self) -> int:
        return len(self._open)

    def connect(self, me: int, senders: list[int], receivers: list[int]) -> None:
        """Open every (sender, receiver) pair that ``me`` belongs to (the lists are disjoint)
        with one small blocking message. All workers go through the pairs in one order (by
        sender, then receiver), so the first pair not yet open always has both ends waiting on
        it: nobody deadlocks."""
        token = torch.zeros(1, dtype=self.kv_buffer.dtype, device=self.device)
        for s in senders:
            for r in receivers:
                if me == s:
                    dist.send(token, r)
                elif me == r:
                    dist.recv(token, s)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # Sending.
    def open_send(self, dest: int) -> int:
        """Start a transfer to ``dest``; returns its id (the receiver needs it)."""
        tid = next(self._ids)
        self._open[(dest, tid, True)] = _Transfer(tid, dest, True)
        return tid

    def send_layers(self, dest: int, transfer_id: int, pages: torch.Tensor,
                    layers: range) -> None:
        """Gather ``layers`` of ``pages`` and post one send per layer."""
        t = self._open[(dest, transfer_id, True)]
        buf = self.gather(self.kv_buffer, pages, layers)
        t.buffers.append(buf)
        t.nbytes += buf.numel() * buf.element_size()
        if t.error is None and dest in self._dead:  # gloo would fail or hang
            t.error = f"worker {dest} is dead"
        if t.error is not None:
            return
        try:
            for j in range(len(layers)):
                t.works.append(dist.isend(buf[j], dest))
        except RuntimeError as e:  # the connection is already gone
            t.error = str(e)

    def close_send(self, dest: int, transfer_id: int) -> int:
        """Every layer is posted: wait for completion in the background. Returns the bytes."""
        t = self._open[(dest, transfer_id, True)]
        if t.error is not None:
            self._finish(t, t.error)
        else:
            self._start(t)
        return t.nbytes

    # Receiving.
    def receive(self, src: int, transfer_id: int, num_pages: int) -> None:
        """Post the receives of a transfer of ``num_pages`` pages from ``src``."""
        t = _Transfer(transfer_id, src, False)
        self._open[(src, transfer_id, False)] = t
        shape = (self.num_layers, 2, num_pages, *self.kv_buffer.shape[3:])
        buf = torch.empty(shape, dtype=self.kv_buffer.dtype, device=self.device)
        t.buffers.append(buf)
        t.nbytes = buf.numel() * buf.element_size()
        if src in self._dead:
            self._finish(t, f"worker {src} is dead")
            return
        try:
            for layer in range(self.num_layers):
                t.works.append(dist.irecv(buf[layer], src))
        except RuntimeError as e:
            self._finish(t, str(e))
            return
        self._start(t)

    def scatter_into(self, buffer: torch.Tensor, pages: torch.Tensor) -> None:
        self.scatter(buffer, self.kv_buffer, pages)

    # Completion.
    def poll(self) -> list[Done]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def peer_dead(self, peer: int) -> None:
        """Abandon every transfer with ``peer``: each is reported failed now, and its waiter
        thread (if any) is left to fail on the closed connection."""
        self._dead.add(peer)
        for t in list(self._open.values()):
            if t.peer == peer:
                self._finish(t, f"worker {peer} died")

    def _start(self, t: _Transfer) -> None:
        threading.Thread(target=self._wait, args=(t,), daemon=True,
                         name=f"kv-{'send' if t.is_send else 'recv'}-{t.transfer_id}").start()

    def _wait(self, t: _Transfer) -> None:
        error = None
        try:
            if self.device.type == "cuda":
                # A new thread's current device is cuda:0; leaving the stream context below
                # would make it current, opening a context there for every worker.
                torch.cuda.set_device(self.device)
                # NCCL's wait() only orders streams: make a private stream wait and sync it,
                # never the model's.
                side = torch.cuda.Stream(self.device)
                with torch.cuda.stream(side):
                    for w in t.works:
                        w.wait()
                side.synchronize()
            else:
                for w in t.works:
                    w.wait()
        except RuntimeError as e:
            error = str(e)
        self._finish(t, error)

    def _finish(self, t: _Transfer, error: str | None) -> None:
        """Report once (dict.pop is atomic: the loop and a waiter may race here)."""
        if self._open.pop((t.peer, t.transfer_id, t.is_send), None) is None:
            return
        buf = None if t.is_send or error else t.buffers[0]
        self._done.put(Done(t.transfer_id, t.peer, t.is_send, error is None, t.nbytes, buf,
                            error))
