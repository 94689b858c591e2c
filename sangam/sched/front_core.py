"""The front's decisions, written once (docs/design.md §1.2, §4.5): the request table and
``Placement``, turned into orders for the workers and driven by the workers' reports. The
engine's front (over one in-process worker, or over worker processes) and the simulator run
this object, the counterpart of the workers' ``WorkerCore``; each supplies only its transport
(``send``: how an order reaches a worker) and its clock (``now`` is an argument)::

    core = FrontCore(deployment, num_pages, send)
    core.add(request_id, arrival, cursor, state=...)   # a request arrives
    core.place()                                       # orders: blocks to run
    placed = core.report(worker, event, now)           # a worker's report
    core.worker_dead(worker)                           # failover
    core.worker_rejoined(worker, num_pages)            # a new process in its place

A request's ``state`` (the engine's decode state, the simulator's draws) and a block's
``progress`` ride through it unread: the driver catches its state up from the progress of the
reports ``report`` returns the request of. The core moves the request's cursor only as the
reports say (``BlockDone``) and when Placement takes it back.

Pure Python: no tensors, no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sangam.sched.block_cursor import BlockCursor
from sangam.sched.config import DeploymentConfig
from sangam.sched.messages import (
    BlockDone,
    Drop,
    Event,
    KVReceived,
    KVSent,
    Order,
    PeerDead,
    Prefill,
    ReceiveKV,
    RefreshRan,
    RequestFailed,
)
from sangam.sched.placement import Placed, Placement


@dataclass
class TransferRecord:
    """One K/V transfer, as the front saw it go and land."""

    request_id: str
    src: int
    dst: int
    num_pages: int
    bytes_sent: int
    streamed_layers: int
    drained: bool  # the receiver was told to discard it
    bytes_received: int | None = None  # None until the receiver reports; then == bytes_sent
    ok: bool | None = None


@dataclass
class FrontCounters:
    kv_transfers: int = 0
    kv_bytes: int = 0
    kv_budget_waits: int = 0  # receives that waited for transfer buffer budget
    blocks: int = 0  # blocks completed
    # The control plane to worker processes, both ways (heartbeats aside): what moving
    # requests between workers costs beyond their K/V (the transport counts them).
    control_messages: int = 0
    control_bytes: int = 0

    def count(self, data: bytes) -> None:
        self.control_messages += 1
        self.control_bytes += len(data)


class FrontCore:
    """Invariants: Placement's, and: a request's ``parked_on`` worker holds a copy of its state
    (it is sent none); every open transfer record is a transfer whose receiver has not reported
    and lives; an event of another attempt changes nothing but transfer records."""

    def __init__(self, deployment: DeploymentConfig, num_pages: Sequence[int],
                 send: Callable[[int, Order], None]):
        """``num_pages``: each worker's KV pool; ``send(worker, order)``: the transport."""
        self.placement = Placement(deployment, num_pages)
        self.requests: dict[str, Placed] = self.placement.requests
        self.counters = FrontCounters()
        self.transfers: deque[TransferRecord] = deque(maxlen=100_000)
        self._open_transfers: dict[tuple[int, int], TransferRecord] = {}
        self._send = send

    # Requests in and out.
    def add(self, request_id: str, arrival_time: float, cursor: BlockCursor, *,
            priority: int = 0, seq: int | None = None, state: Any = None,
            prompt_ids: list[int] | None = None) -> Placed:
        """A new request (its id not in use), to be placed (raises ``NeverFits`` and changes
        nothing when no live worker could ever hold its canvas)."""
        return self.placement.add(request_id, arrival_time, cursor, priority=priority, seq=seq,
                                  state=state, prompt_ids=prompt_ids)

    def abort(self, request_id: str) -> Placed | None:
        """Forget a request (aborted or failed in the front) and tell every worker that may hold
        part of it; None if it is not here."""
        p = self.requests.get(request_id)
        if p is not None:
            self._drop(request_id, self.placement.remove(request_id))
        return p

    # Orders.
    def place(self) -> None:
        """Place every block that can be placed now: a ``Prefill`` to each worker chosen."""
        for d in self.placement.place():
            p = self.requests[d.request_id]
            self._send(d.worker, Prefill(d.request_id, d.attempt, self._state_for(p, d.worker),
                                         p.arrival_time, p.seq, d.kv_dest, d.keep_pages,
                                         d.stays))

    def _state_for(self, p: Placed, worker: int) -> Any:
        """What ``worker`` is sent of the request's state: none if it parked a copy (which the
        order then takes out of parking), else the front's."""
        if p.parked_on == worker:
            p.parked_on = None
            return None
        return p.state

    def _drop(self, request_id: str, workers: set[int]) -> None:
        p = self.requests.get(request_id)
        if p is not None and p.parked_on in workers:
            p.parked_on = None
        for w in workers:
            self._send(w, Drop(request_id))

    # Reports.
    def report(self, worker: int, ev: Event, now: float) -> Placed | None:
        """Apply one of ``worker``'s reports, received at ``now``: returns the request it is
        about when it is about its current attempt (None: about work taken back, aborted or
        drained, which changes nothing but the transfer records)."""
        p = self.placement.current(ev.request_id, ev.attempt)
        if isinstance(ev, KVReceived):
            self.counters.kv_budget_waits += ev.budget_wait
            record = self._open_transfers.pop((ev.src, ev.transfer_id), None)
            if record is not None:
                record.bytes_received, record.ok = ev.nbytes, ev.ok
                if record.drained:
                    p = None
        if isinstance(ev, KVSent):
            return self._kv_sent(worker, ev, p)
        if p is None:
            return None
        if isinstance(ev, RefreshRan):
            self.placement.refreshed(p, worker, now - ev.seconds, now, ev.chunk)
            p.cached_tokens = ev.cached_tokens
        elif isinstance(ev, KVReceived):
            self._drop(ev.request_id, self.placement.kv_received(p, worker, ev.ok, ev.pages))
        elif isinstance(ev, BlockDone):
            self._block_done(worker, ev, p, now)
        elif isinstance(ev, RequestFailed):
            self._drop(ev.request_id, self.placement.remove(ev.request_id))
        return p

    def _kv_sent(self, w: int, ev: KVSent, p: Placed | None) -> Placed | None:
        """``w`` sent a refresh's K/V: the receiver is told to take it (or to drain it, when the
        request is gone or the refresh needs no K/V); a failed send restarts the block."""
        drain = self.placement.kv_sent(p, w, ev.dest, ev.drain)
        failed = not ev.ok and not drain  # filler went out: the receiver discards it
        record = TransferRecord(ev.request_id, w, ev.dest, ev.num_pages, ev.nbytes,
                                ev.streamed_layers, drain or failed)
        self.transfers.append(record)
        if ev.dest in self.placement.dead:
            return p  # the sender abandons it (PeerDead); the request was taken back
        self._open_transfers[(w, ev.transfer_id)] = record
        arrival, seq = (p.arrival_time, p.seq) if p is not None else (0.0, 0)
        state, progress = ((None, None) if record.drained
                           else (self._state_for(p, ev.dest), ev.progress))
        self._send(ev.dest, ReceiveKV(ev.request_id, ev.attempt, w, ev.transfer_id,
                                      ev.num_pages, state, progress, arrival, seq,
                                      record.drained))
        if failed:
            self._drop(ev.request_id, self.placement.kv_received(p, ev.dest, False, []))
        if not record.drained:
            p.kv_bytes += ev.nbytes
            p.kv_transfers += 1
            self.counters.kv_transfers += 1
            self.counters.kv_bytes += ev.nbytes
        return p

    def _block_done(self, w: int, ev: BlockDone, p: Placed, now: float) -> None:
        """A block ended on ``w``: the request's cursor catches up with the worker's, then its
        next block runs on without being placed, waits to be placed, or it is done."""
        p.cursor.catch_up(ev.block, ev.step, ev.force_refresh)
        if ev.continues:
            self.placement.block_continued(p, ev.forwards, now)
        else:
            p.parked_on = w if ev.pages else None
            self._drop(ev.request_id, self.placement.block_done(p, w, ev.finished, ev.forwards,
                                                                list(ev.pages), now))
        self.counters.blocks += 1

    # Failures.
    def worker_rejoined(self, w: int, num_pages: int) -> None:
        """Dead worker ``w`` serves again (a new process, empty, with ``num_pages``)."""
        self.placement.worker_rejoined(w, num_pages)

    def worker_dead(self, w: int) -> list[tuple[Placed, set[int]]]:
        """Worker ``w`` is gone: every request with anything on it restarts its block elsewhere,
        dropped from every other worker, and the live workers abandon transfers with it.
        Returns the requests taken back (raises when no worker is left)."""
        for key, record in list(self._open_transfers.items()):
            if record.dst == w:  # its report will never come
                record.ok = False
                del self._open_transfers[key]
        for p in self.requests.values():
            if p.parked_on == w:
                p.parked_on = None
        taken = self.placement.worker_dead(w)
        for other in range(len(self.placement.roles)):
            if other not in self.placement.dead:
                self._send(other, PeerDead(w))
        for p, drops in taken:
            self._drop(p.request_id, drops)
        return taken
