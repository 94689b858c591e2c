"""A worker process: the in-process ``Worker`` (sangam/engine/worker.py) with a K/V transport
(``TransferWorker``), driven by the front over a control socket (``WorkerProcess``).

It never routes: the front tells it what to run (``Prefill``), what to receive (``ReceiveKV``)
and what to forget (``Drop``); it schedules that work locally under its own deficit budget and
reports what happened (``Report``), one message per loop turn.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from sangam.decoding.state import DecodeState
from sangam.engine import messages as msg
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.model_runner import FATAL_ERRORS, ModelRunner
from sangam.engine.multi import data_plane
from sangam.engine.multi.follower import run_follower
from sangam.engine.multi.kv_transfer import KVTransport, layer_hook
from sangam.engine.multi.launcher import WorkerSpec, signature
from sangam.engine.tensor_group import TensorGroup, global_rank
from sangam.engine.worker import Worker, build_worker_parts, scheduling_request, worker_control
from sangam.engine.worker_control import WorkerControl
from sangam.sched.batch_builder import BatchBuilder
from sangam.sched.request import Request, StepOutcome
from sangam.sched.worker_core import Ship

HEARTBEAT_S = 0.5
_IDLE_POLL_MS = 100
# While it has work, the loop reports at least this often even when nothing changed: the
# front's watchdog tells a live loop waiting on a peer from a hung one by these reports.
_KEEPALIVE_S = 1.0


@dataclass
class _Stream:
    """A transfer posted layer by layer during the forward (layer-wise streaming)."""

    dest: int
    transfer_id: int
    page_ids: torch.Tensor
    layers_sent: int = 0


class TransferWorker(Worker):
    """A worker that also moves K/V (disaggregated and hybrid serving): it receives refreshes
    for its canvases and ships its refreshes' K/V to their canvas holders. A test may give
    stand-ins (a runner without a model, an in-process transport)."""

    remote = True

    def __init__(self, index: int, builder: BatchBuilder, runner: ModelRunner,
                 transport: KVTransport | None, loaded: LoadedModel | None = None,
                 streaming: bool = False, control: WorkerControl | None = None):
        """``streaming``: a forward's first refresh for each receiver sends its K/V layer by
        layer while the forward runs (``WorkerCore.schedule`` picks them)."""
        super().__init__(index, builder, runner, streaming, control)
        self.transport = transport
        self.loaded = loaded  # its model takes layer-wise streaming's hook
        self._streams: dict[str, _Stream] = {}  # this iteration's

    def handle(self, m: object) -> None:
        if isinstance(m, msg.ReceiveKV):
            self._on_receive(m)
        elif isinstance(m, msg.PeerDead):
            if self.transport is not None:
                self.transport.peer_dead(m.worker)
        else:
            super().handle(m)

    def _on_receive(self, m: msg.ReceiveKV) -> None:
        req = None
        if not m.drain:
            state = self.core.parked_state(m.request_id) if m.state is None else m.state
            msg.catch_up(state, m.progress)
            req = scheduling_request(m, state, keep_pages=True,
                                     starts_block=state.cursor.step == 0)
        self.core.expect_kv((m.src, m.transfer_id), m.request_id, m.attempt, req, m.num_pages)
        self.transport.receive(m.src, m.transfer_id, m.num_pages)

    def iterate(self) -> bool:
        """One iteration, unless the sends in flight fill the transfer buffer budget (then
        nothing runs until they drain: the next forward could gather more)."""
        if self.transport is not None and self.transport.sends_throttled():
            return False
        return super().iterate()

    def poll_transfers(self) -> bool:
        """Take in the K/V transfers that ended; whether any did. Raises when a pair with a
        live peer failed for good (``KVTransport.check``)."""
        if self.transport is None:
            return False
        done = self.transport.poll()
        for d in done:
            if d.is_send:
                continue  # the buffer is released; a failed send is the front's business
            key = (d.peer, d.transfer_id)
            r = self.core.receiving[key]
            self.transport.scatter_received(d, list(r.pages) if d.ok and r.pages is not None
                                            else None)
            r, seated = self.core.kv_arrived(key, d.ok, self.clock())
            self.events.append(msg.KVReceived(r.request_id, r.attempt, d.peer, d.transfer_id,
                                              seated, d.nbytes, list(r.pages) if seated else [],
                                              d.waited))
        return bool(done)

    def _execute(self, reqs: list[Request], states: list[DecodeState],
                 pages: list[list[int]]) -> list[StepOutcome]:
        self._streams = {r.request_id: self._open_stream(r) for r in reqs if r.streamed}
        rings = self._rings(reqs)
        if not self._streams:
            return self.runner.execute(states, pages, rings=rings)
        # The other ranks of a tensor-parallel group stream their shards of the same pages.
        self.runner.streams = [(s.dest, s.transfer_id, s.page_ids.tolist())
                               for s in self._streams.values()]
        try:
            return self._execute_streaming(states, pages, rings)
        finally:
            self.runner.streams = []

    def _open_stream(self, req: Request) -> _Stream:
        """Open a streamed refresh's transfer before the forward (``Request.streamed``: the
        batch's first to its receiver)."""
        return _Stream(req.kv_dest, self.transport.open_send(req.kv_dest),
                       self._page_ids(req.pages))

    def _page_ids(self, pages: list[int]) -> torch.Tensor:
        """A request's pages on the device, once per transfer (not per layer, which would
        copy and sync each time)."""
        return torch.tensor(pages, dtype=torch.int64).to(self.transport.device)

    def _execute_streaming(self, states: list[DecodeState], pages: list[list[int]],
                           rings: list[list[int]] | None) -> list[StepOutcome]:
        """The forward with each finished layer's K/V posted to its stream. If the batch fails,
        its requests run again alone (``ModelRunner.execute``) without streaming: the layers
        already posted stand (a request's K/V does not depend on its batch), ``_ship`` sends
        the rest."""
        # Mid-forward, only this rank's sends: the others post theirs from their own forward.
        local = self.transport.local

        def on_layer(layer: int) -> None:
            for s in self._streams.values():
                local.send_layers(s.dest, s.transfer_id, s.page_ids, range(layer, layer + 1))
                s.layers_sent += 1

        try:
            with layer_hook(self.loaded.model, on_layer):  # graphs skip hooks
                return self.runner.execute(states, pages, allow_graphs=False, isolate=False,
                                           rings=rings)
        except FATAL_ERRORS:
            raise
        except Exception:
            return self.runner.execute(states, pages, allow_graphs=False, rings=rings)

    def _ship(self, ship: Ship) -> None:
        """Send a refresh's K/V to the canvas holder, or finish its streamed send (a drained
        one too: its last layers go now, and the receiver drains them)."""
        r = ship.request
        dest = r.kv_dest
        layers = self.transport.num_layers
        stream = self._streams.pop(r.request_id, None)
        if stream is None:
            tid = self.transport.open_send(dest)
            self.transport.send_layers(dest, tid, self._page_ids(ship.pages), range(layers))
            streamed = 0
        else:
            tid, streamed = stream.transfer_id, stream.layers_sent
            if streamed < layers:  # the streamed forward failed and the request ran again
                self.transport.send_layers(dest, tid, stream.page_ids, range(streamed, layers))
        nbytes, ok = self.transport.close_send(dest, tid)
        self.events.append(msg.KVSent(r.request_id, r.attempt, dest, tid, len(ship.pages),
                                      nbytes, streamed, msg.block_progress(r.state, ship.block),
                                      ship.drain, ok))


class WorkerProcess:
    """A worker's loop in its own process: control messages in, iterations, reports out."""

    def __init__(self, worker: Worker, sock: zmq.Socket):
        self.worker = worker
        self.sock = sock
        self._stalled = False  # the last iteration found nothing, and nothing changed since
        self._handled = 0  # control messages handled
        self._reported = (-1, -1, -1, False)  # (free pages, open transfers, handled, busy)
        self._reported_at = 0.0

    def send(self, message: object) -> None:
        self.sock.send(msg.dumps(message))

    def serve(self) -> None:
        w = self.worker
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while True:
            if poller.poll(self._poll_timeout_ms()):
                while True:
                    try:
                        data = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    message = msg.loads(data)
                    if isinstance(message, msg.Shutdown):
                        return
                    w.handle(message)
                    self._handled += 1
                    self._stalled = False
            if w.poll_transfers():
                self._stalled = False
            self._stalled = not w.iterate()
            self.flush()

    def _poll_timeout_ms(self) -> int:
        w = self.worker
        if w.builder.has_work and not self._stalled:
            return 0
        if w.transport is not None and w.transport.num_open:
            return 1  # completions arrive through a queue, not the socket
        return _IDLE_POLL_MS

    def flush(self) -> None:
        """Report what happened since the last report (or, while busy, that the loop lives)."""
        w = self.worker
        open_transfers = w.transport.num_open if w.transport is not None else 0
        busy = w.core.busy or bool(open_transfers)
        now = (w.builder.allocator.num_free, open_transfers, self._handled, busy)
        t = time.monotonic()
        if (w.events or w.iterations or now != self._reported
                or (busy and t - self._reported_at >= _KEEPALIVE_S)):
            self.send(msg.Report(w.index, w.events, w.iterations, *now))
            w.events, w.iterations, self._reported = [], [], now
            self._reported_at = t

def start_worker(spec: WorkerSpec, sock: zmq.Socket) -> WorkerProcess:
    """Load the model (rank 0's shard of it under tensor parallelism), join the data plane,
    build the worker's parts, and say Hello."""
    config, device, loaded = data_plane.load_rank(spec)

    def build(group: TensorGroup | None):
        pool, builder, runner = build_worker_parts(config, loaded, group)
        return (pool, builder, runner), pool.kv

    (pool, builder, runner), group, transport = data_plane.join(spec, device, build)
    if group is not None and transport is not None:
        transport = data_plane.MirroredTransport(transport, group)
    rank = global_rank(spec.worker, 0, config.tensor_parallel_size)
    worker = TransferWorker(spec.worker, builder, runner, transport, loaded,
                            config.layerwise_kv_streaming,
                            worker_control(config, loaded, pool, runner, builder, rank))
    process = WorkerProcess(worker, sock)
    process.send(msg.Hello(
        spec.worker, os.getpid(), socket.gethostname(), spec.device, pool.num_pages,
        pool.kv.page_bytes() // (2 * len(pool.kv.k)),
        signature(spec.roles, spec.config, loaded.config)))
    return process


def thread_cpu_seconds(native_id: int) -> float | None:
    """CPU time a thread of this process has used (Linux's /proc); None where unknown."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _watchdog(ctx: zmq.Context, spec: WorkerSpec, parent_pid: int, loop_thread: int) -> None:
    """Heartbeats to the front, each with the CPU time the loop's thread has used (so the
    front tells a loop busy in one long operation from a stuck one), and exit when the parent
    or the front is gone (a SIGKILLed front runs no cleanup: its workers must notice by
    themselves) or when the front says ``Kill`` (it declared this worker dead, perhaps because
    the loop hung)."""
    hb = ctx.socket(zmq.DEALER)
    hb.setsockopt(zmq.IDENTITY, f"h{spec.worker}".encode())
    hb.setsockopt(zmq.LINGER, 0)
    # ZeroMQ's pings, answered by the front's I/O thread: a front that cannot be heard for
    # --heartbeat-timeout (a partition) closes this connection, and the worker stops below.
    hb.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_S * 1000))
    hb.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(spec.config.heartbeat_timeout * 1000))
    monitor = hb.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    hb.connect(spec.front_addr)
    poller = zmq.Poller()
    poller.register(monitor, zmq.POLLIN)
    poller.register(hb, zmq.POLLIN)
    connected = False
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        try:
            hb.send(msg.dumps(msg.Heartbeat(spec.worker, thread_cpu_seconds(loop_thread))),
                    zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet
        deadline = time.monotonic() + HEARTBEAT_S
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if hb in ready and isinstance(msg.loads(hb.recv()), msg.Kill):
                os._exit(1)
            if monitor in ready:
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event == zmq.EVENT_CONNECTED:
                    connected = True
                elif event == zmq.EVENT_DISCONNECTED and connected:
                    os._exit(1)


def run_worker(spec: WorkerSpec, parent_pid: int) -> None:
    """Entry point of a forked worker process (its parent is ``parent_pid``). Never returns:
    the process ends with os._exit, skipping teardown that could block on a dead peer
    (destroying a process group talks to every rank). Ranks 1.. of a tensor-parallel worker
    run ``follower.run_follower`` instead."""
    if spec.tp_rank:
        run_follower(spec, parent_pid)
    # Ctrl-C reaches the whole foreground process group; the front shuts workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"w{spec.worker}".encode())
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(spec.front_addr)
    threading.Thread(target=_watchdog, args=(ctx, spec, parent_pid, threading.get_native_id()),
                     daemon=True, name="sangam-watchdog").start()
    code = 0
    try:
        process = start_worker(spec, sock)
        process.serve()
        group = process.worker.runner.group
        if group is not None:
            group.send(None)  # shutdown: the other ranks end too
    except BaseException:
        sock.send(msg.dumps(msg.WorkerFailed(spec.worker, traceback.format_exc())))
        code = 1
    sock.close()  # lingers until the last report is out
    os._exit(code)

