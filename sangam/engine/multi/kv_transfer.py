"""K/V transfer between workers: torch.distributed point-to-point (docs/design.md §4, KV transfer).

One transfer moves one request's pages, every layer, K and V. Per layer ``l`` the sender gathers
layer ``l`` of the request's pages into a contiguous buffer ``[2, n, page_size, Hkv, D]`` (the
page kernel; its PyTorch reference on CPU) and posts a send; the receiver posts a receive of the
same shape per layer and, once all arrived, scatters them into its own pages (page ids differ
between the two pools). NCCL carries it on GPU, gloo on CPU. A pool whose layers have K/V
shapes of their own (DiffusionGemma: one tensor per shape, ``PagedKV.buffers``) moves each
layer in its own shape, gathered and scattered per tensor.

Each sender-receiver pair has its own process group (``connect`` creates them all at startup,
every worker in one order, and opens each with one message: NCCL opens a communicator at its
first operation, blocking until both ends take part). When the front declares a worker dead,
its pairs are aborted (``peer_dead``): under NCCL that ends the pending operations at once
instead of leaving them to spin until the watchdog; gloo cannot abort a pending wait, but it
fails every operation of a pair whose peer process closed its sockets, so the same path serves
both. A pair's timeout (``--transfer-timeout``) bounds every wait; a pair that failed while its
peer is not known dead has lost the posting order, so it is used no more, and if the front does
not declare the peer dead within ``--watchdog-timeout`` (it would, were the peer hung) this
worker gives up (``check``) and the front's failover takes over.

Sends and receives of a pair match in the order they are posted: NCCL ignores tags, so none
are used, and gloo then matches the same way (the CPU tests check the rule NCCL needs). A
sender therefore posts all layers of a transfer before the next transfer to the same
receiver, and the receiver posts its receives in the order the front relays the transfers,
which is the order the sender reported them.

Flow control: transfer buffers come out of a byte budget (``--transfer-buffer-bytes``) beside
the KV pool. Receives are posted in arrival order as the budget allows (a receive waits, it is
never refused: its sender's sends wait for it); one larger than the whole budget goes alone.
A sender
whose gathered sends fill the budget runs no forward until they drain (``sends_throttled``);
one forward may overshoot it by its own transfers.
An out-of-memory error while gathering or allocating becomes a failed transfer, not a worker
exit: the sender posts filler from one layer's buffer and reports the transfer failed, the
receiver waits for memory or drains through one layer's buffer.

Completion is never polled from the worker loop directly: gloo's ``Work.is_completed()`` stays
False until ``wait()`` is called. So a daemon thread waits on each transfer's works and reports
into a queue the loop drains.

Layer-wise streaming: ``LayerHook`` wraps the attention backend for one forward and calls back
after each layer's attention, by which time that layer's K/V of every span is in its pages, so
the sender posts layer ``l`` while layer ``l + 1`` computes.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from sangam.engine.tensor_group import global_rank
from sangam.models import AttentionBackend, AttentionMetadata, DiffusionLM, PagedKV
from sangam.models.kernel_table import backend_name, kernel_table


def layer_page_bytes(kv_buffer: torch.Tensor) -> int:
    """Bytes of one page of one layer's K (or V): ``page_size * Hkv * D * element size``."""
    return kv_buffer[0, 0, 0].numel() * kv_buffer.element_size()


def _page_ops(device: torch.device):
    """The page gather/scatter kernels of the device's row of the kernel table: Triton on GPU,
    their PyTorch references on CPU."""
    table = kernel_table(backend_name(device))
    return table.gather_pages, table.scatter_pages


@contextmanager
def layer_hook(model: DiffusionLM, on_layer: Callable[[int], None]) -> Iterator[None]:
    """``model``'s forwards inside call ``on_layer(i)`` after layer ``i``'s attention."""
    inner = model.attention_backend
    model.attention_backend = LayerHook(inner, on_layer)
    try:
        yield
    finally:
        model.attention_backend = inner


class LayerHook(AttentionBackend):
    """An attention backend that calls ``on_layer(i)`` after layer ``i``'s attention. It bears
    the inner backend's name: the model picks its other kernels (MoE) by it."""

    def __init__(self, inner: AttentionBackend, on_layer: Callable[[int], None]):
        self.inner = inner
        self.name = inner.name
        self.on_layer = on_layer
        self.layer = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor,
                v_pages: torch.Tensor, meta: AttentionMetadata, scale: float,
                sliding: bool = False, k_scales: torch.Tensor | None = None,
                v_scales: torch.Tensor | None = None) -> torch.Tensor:
        out = self.inner.forward(q, k, v, k_pages, v_pages, meta, scale, sliding, k_scales,
                                 v_scales)
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
    # A receive's data, per tensor of the pool (PagedKV.buffers): [layers, 2, n, page_size,
    # Hkv, D] each.
    buffer: tuple[torch.Tensor, ...] | None
    error: str | None = None
    waited: bool = False  # a receive that found the budget full and waited its turn


@dataclass
class _Transfer:
    transfer_id: int
    peer: int
    is_send: bool
    buffers: list[torch.Tensor] = field(default_factory=list)  # kept alive until completion
    works: list = field(default_factory=list)
    nbytes: int = 0  # what crosses the wire
    held: int = 0  # bytes of ``buffers``, charged to the budget until they are let go
    error: str | None = None  # a post failed: reported when the transfer closes
    num_pages: int = 0  # a receive's
    drain: bool = False  # a receive out of memory: through one layer's buffer, discarded
    waited: bool = False  # a receive that found the budget full


class KVTransport:
    """One worker's end of the data plane. Called from the worker loop only; waiter threads
    touch nothing but their transfer's works and the two queues (completions, released
    bytes)."""

    def __init__(self, kv: PagedKV | torch.Tensor, budget_bytes: int, give_up_s: float):
        kv = kv if isinstance(kv, PagedKV) else PagedKV(kv)
        self.buffers = kv.buffers
        self.slots = kv.layer_slots  # layer -> (tensor, index in it)
        self.kv_buffer = kv.buffers[0]
        self.device = self.kv_buffer.device
        self.num_layers = len(self.slots)
        self.gather, self.scatter = _page_ops(self.device)
        self.budget = budget_bytes
        self.give_up_s = give_up_s  # after a pair with a live peer failed
        self.held_send = 0  # bytes of buffers charged to the budget, by direction
        self.held_recv = 0
        self._ids = itertools.count()
        self._groups: dict[int, dist.ProcessGroup] = {}  # by peer
        self._ranks: dict[int, int] = {}  # peer worker -> its rank's torch.distributed rank
        self._open: dict[tuple[int, int, bool], _Transfer] = {}  # (peer, id, is_send)
        self._waiting: deque[_Transfer] = deque()  # receives not posted yet, in arrival order
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._released: queue.SimpleQueue[tuple[bool, int]] = queue.SimpleQueue()
        self._dead: set[int] = set()
        self._broken: dict[int, float] = {}  # peer -> when a pair failed with it alive

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def local(self) -> KVTransport:
        """This process's own transport (itself; a tensor-parallel rank 0's mirror answers
        the transport it wraps): what posts sends from inside a forward."""
        return self

    def connect(self, me: int, senders: list[int], receivers: list[int],
                timeout_s: float, tp_rank: int = 0, tp_size: int = 1) -> None:
        """Create a process group per (sender, receiver) pair, with ``timeout_s`` on every
        wait, and open those ``me`` belongs to with one small blocking message. Every worker
        creates every group (NCCL splits them off the default communicator, which all ranks
        take part in) and opens the pairs in one order (by sender, then receiver), so the
        first pair not yet open always has both ends waiting on it: nobody deadlocks.

        Workers of ``tp_size`` ranks each (tensor parallelism) pair rank to rank: this
        process, rank ``tp_rank`` of worker ``me``, moves its KV heads' pages with rank
        ``tp_rank`` of every peer, which holds the same heads."""
        timeout = datetime.timedelta(seconds=timeout_s)
        for s in senders:
            for r in receivers:
                for t in range(tp_size):
                    ends = [global_rank(s, t, tp_size), global_rank(r, t, tp_size)]
                    group = dist.new_group(ends, timeout=timeout)
                    if me in (s, r) and t == tp_rank:
                        peer = r if me == s else s
                        self._groups[peer] = group
                        self._ranks[peer] = global_rank(peer, t, tp_size)
        token = torch.zeros(1, dtype=self.kv_buffer.dtype, device=self.device)
        for s in senders:
            for r in receivers:
                if me == s:
                    dist.send(token, self._ranks[r], group=self._groups[r])
                elif me == r:
                    dist.recv(token, self._ranks[s], group=self._groups[s])
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
        """Gather ``layers`` of ``pages`` and post one send per layer. Out of memory, the
        transfer fails but its sends are still posted (this call's and later ones'), from one
        layer's filler buffer: the receiver will post its receives all the same."""
        t = self._open[(dest, transfer_id, True)]
        refusal = self._refusal(dest)
        if refusal is not None:  # nothing goes through that pair again
            t.error = t.error or refusal
            return
        try:
            if len(self.buffers) == 1:
                bufs = [self.gather(self.kv_buffer, pages, layers)]
                views = list(bufs[0])
            else:  # layers of different shapes: one gather each
                bufs = [self.gather(self.buffers[b], pages, range(j, j + 1))
                        for b, j in (self.slots[layer] for layer in layers)]
                views = [buf[0] for buf in bufs]
        except torch.OutOfMemoryError:
            fillers = {b: torch.zeros((1, 2, len(pages), *t.shape[3:]), dtype=t.dtype,
                                      device=self.device) for b, t in enumerate(self.buffers)}
            bufs = list(fillers.values())
            views = [fillers[self.slots[layer][0]][0] for layer in layers]
            t.error = t.error or "out of memory gathering the K/V"
        for buf in bufs:
            self._hold(t, buf)
        t.nbytes += sum(v.numel() * v.element_size() for v in views)
        try:
            for v in views:
                t.works.append(dist.isend(v, self._ranks[dest], group=self._groups[dest]))
        except RuntimeError as e:  # the connection is already gone
            t.error = t.error or str(e)

    def close_send(self, dest: int, transfer_id: int) -> tuple[int, bool]:
        """Every layer is posted: wait for completion in the background. Returns the bytes,
        and whether the K/V went out (else the request must be placed again; what was posted
        is filler for the receiver to discard)."""
        t = self._open[(dest, transfer_id, True)]
        ok = t.error is None
        if t.works:
            self._start(t)
        else:
            self._finish(t, t.error)
            self._release(t)
        return t.nbytes, ok

    def sends_throttled(self) -> bool:
        """Whether the sends in flight hold the whole budget: then run no forward that could
        gather more (they drain without this worker's help: every receiver posts in turn)."""
        return self.held_send >= self.budget

    # Receiving.
    def receive(self, src: int, transfer_id: int, num_pages: int) -> None:
        """Receive a transfer of ``num_pages`` pages from ``src``, posted as soon as the
        transfers before it are and the budget allows."""
        t = _Transfer(transfer_id, src, False, num_pages=num_pages)
        t.nbytes = sum(self._layer_bytes(b, num_pages) * buf.shape[0]
                       for b, buf in enumerate(self.buffers))
        self._open[(src, transfer_id, False)] = t
        self._waiting.append(t)
        self._pump()

    def _pump(self) -> None:
        """Post the waiting receives, in order, while the budget allows (a waiting receive
        that is no longer open, its peer dead, is skipped)."""
        while self._waiting:
            t = self._waiting[0]
            if self._open.get((t.peer, t.transfer_id, False)) is not t:
                self._waiting.popleft()
                continue
            refusal = self._refusal(t.peer)
            if refusal is not None:
                self._waiting.popleft()
                self._finish(t, refusal)
                continue
            if self.held_recv and self.held_send + self.held_recv + t.nbytes > self.budget:
                t.waited = True
                return  # (one larger than the whole budget goes alone)
            if not self._post_receive(t):
                return  # out of memory with others in flight: wait for them
            self._waiting.popleft()

    def _post_receive(self, t: _Transfer) -> bool:
        try:
            bufs = [torch.empty((1 if t.drain else kv.shape[0], 2, t.num_pages, *kv.shape[3:]),
                                dtype=kv.dtype, device=self.device) for kv in self.buffers]
        except torch.OutOfMemoryError:
            if self.held_recv or t.drain:
                return False
            t.drain, t.error = True, "out of memory receiving the K/V"
            return self._post_receive(t)  # drained through one layer's buffer per shape
        for buf in bufs:
            self._hold(t, buf)
        layers = [bufs[b][0 if t.drain else j] for b, j in self.slots]
        try:
            for v in layers:
                t.works.append(dist.irecv(v, self._ranks[t.peer], group=self._groups[t.peer]))
        except RuntimeError as e:
            self._finish(t, str(e))
            self._release(t)
            return True
        self._start(t)
        return True

    def scatter_received(self, done: Done, pages: list[int] | None) -> None:
        """Scatter a finished receive into ``pages`` of the pool (None: it is not wanted)."""
        if pages is not None:
            ids = torch.tensor(pages, dtype=torch.int64)
            for buf, kv in zip(done.buffer, self.buffers, strict=True):
                self.scatter(buf, kv, ids)

    # Completion.
    def poll(self) -> list[Done]:
        """The transfers that ended since the last poll. First the receives that waited are
        posted as far as the buffers let go of by the last poll allow (the loop has scattered
        and dropped those by now); raises as ``check`` does."""
        self.check()
        self._pump()
        while True:
            try:
                is_send, n = self._released.get_nowait()
            except queue.Empty:
                break
            if is_send:
                self.held_send -= n
            else:
                self.held_recv -= n
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def check(self) -> None:
        """Raise when a pair failed while its peer lives on and the front has not declared
        that peer dead within ``give_up_s``: the pair cannot be trusted (its posting order is
        lost), so this worker leaves, and failover places its requests again."""
        now = time.monotonic()
        for peer, since in list(self._broken.items()):
            if peer not in self._dead and now - since > self.give_up_s:
                raise RuntimeError(f"the K/V connection with worker {peer} failed "
                                   f"{now - since:.0f}s ago and that worker lives on")

    def peer_dead(self, peer: int) -> None:
        """Abandon every transfer with ``peer``: each is reported failed now; the pair's
        process group is aborted, which under NCCL ends its pending operations (gloo's end
        when the dead process's sockets close, or at the pair's timeout)."""
        self._dead.add(peer)
        for t in list(self._open.values()):
            if t.peer == peer:
                self._finish(t, f"worker {peer} died")
                if not t.works:
                    self._release(t)
        group = self._groups.pop(peer, None)
        if group is not None:
            dist.distributed_c10d._abort_process_group(group)

    def _refusal(self, peer: int) -> str | None:
        if peer in self._dead:
            return f"worker {peer} is dead"
        if peer in self._broken:
            return f"the K/V connection with worker {peer} failed"
        return None

    def _layer_bytes(self, tensor: int, num_pages: int) -> int:
        """One layer's K and V of ``num_pages`` pages, in pool tensor ``tensor``."""
        return 2 * num_pages * layer_page_bytes(self.buffers[tensor])

    def _hold(self, t: _Transfer, buf: torch.Tensor) -> None:
        n = buf.numel() * buf.element_size()
        t.buffers.append(buf)
        t.held += n
        if t.is_send:
            self.held_send += n
        else:
            self.held_recv += n

    def _release(self, t: _Transfer) -> None:
        """``t``'s buffers are let go (by its waiter thread, or the loop): back to the budget at
        the next poll. A received buffer still travels in its ``Done``, which the loop scatters
        before it posts more."""
        self._released.put((t.is_send, t.held))

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
                # NCCL's wait() blocks this thread (TORCH_NCCL_BLOCKING_WAIT, set by the
                # worker) and raises on a timeout or an aborted pair; the private stream keeps
                # the model's out of it.
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
            self._broken.setdefault(t.peer, time.monotonic())  # atomic: the loop reads it
        self._finish(t, error or t.error)
        self._release(t)

    def _finish(self, t: _Transfer, error: str | None) -> None:
        """Report once (dict.pop is atomic: the loop and a waiter may race here)."""
        if self._open.pop((t.peer, t.transfer_id, t.is_send), None) is None:
            return
        ok = error is None
        buf = None if t.is_send or not ok else tuple(t.buffers)
        self._done.put(Done(t.transfer_id, t.peer, t.is_send, ok, t.nbytes, buf, error,
                            t.waited))
