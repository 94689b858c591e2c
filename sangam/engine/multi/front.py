"""``MultiWorkerEngine``: the front (``engine/front.py``) over worker processes
(docs/design.md §4, Modes): it starts them, sends them the front's messages over ZeroMQ, reads
their reports, and watches them.

It is a ``SteppedEngine`` as the in-process ``Engine`` is, so ``LLM`` and ``AsyncEngine`` drive
either. Per request the front keeps the ``DecodeState`` as of the start of the block to run
next (caught up from each block's report), which is all that recovery needs, because a block's
refresh recomputes every layer's K/V of every position from the tokens alone.

Failures: a worker found dead (its process exited, it reported a failure, its heartbeats
stopped, or it had work and its loop reported nothing for ``watchdog_timeout`` seconds while
not computing - its heartbeats say how much CPU the loop used - or for ``BUSY_SILENCE_FACTOR``
times as long while computing) is
marked dead in the router and reported in ``dead_workers``, and made to exit if it still runs
(a worker on this node is killed, one on another node is told to by its heartbeat thread).
Every request that had anything on it is taken back to the start of its current block (the
snapshot), dropped from every other worker, and placed again. Refreshes and noise keys depend
only on (tokens, block, step), so it finishes with the same tokens. A K/V transfer the
receiver could not take is retried the same way.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from sangam.config import EngineConfig
from sangam.engine import messages as msg
from sangam.engine.front import ControlRefused, Front
from sangam.engine.interface import Gauge
from sangam.engine.loaded_model import LoadedModel, checkpoint_path
from sangam.engine.multi import data_plane, launcher, network
from sangam.models import read_config, resolve_dtype
from sangam.sampling_params import RequestOutput

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # model loading on every worker of every node
# A loop whose thread used this share of a core between two heartbeats is computing (one long
# forward or K/V gather), not stuck in a wait; but a wedged device can keep a thread spinning,
# so a computing loop that does not report is declared hung after this many watchdog timeouts.
COMPUTING_CPU_SHARE = 0.1
BUSY_SILENCE_FACTOR = 10.0
_POLL_MS = 10  # step() waits this long for a worker report when there is nothing to return
_SHUTDOWN_WAIT_S = 10.0

@dataclass
class _WorkerInfo:
    hello: msg.Hello
    last_heard: float
    free_pages: int  # as last reported
    open_transfers: int = 0
    sent: int = 0  # control messages sent to it
    # Since when it owes a report: it has work (or unhandled messages) and has not reported
    # since; a live worker loop with work reports at least every second. None while idle.
    owes_progress_since: float | None = None
    loop_cpu: tuple[float, float] | None = None  # (time, loop CPU seconds) of the last beat
    computing_at: float = 0.0  # when a heartbeat last showed its loop computing


@dataclass
class WorkerState:
    """One worker as the front last heard of it."""

    role: str
    alive: bool
    pid: int
    host: str
    device: str
    num_pages: int
    layer_page_bytes: int
    free_pages: int
    open_transfers: int


def _front_model(config: EngineConfig, loaded: LoadedModel | None,
                 device: str) -> LoadedModel:
    """Tokenizer, stop tokens and request validation without weights (``model=None``): the
    workers hold the model."""
    if loaded is not None:
        return loaded
    path = checkpoint_path(config)
    dtype = resolve_dtype(None if config.dtype == "auto" else config.dtype, device)
    return LoadedModel.around(config, path, None, read_config(path), torch.device(device), dtype)


class MultiWorkerEngine(Front):
    """The front over worker processes (one per device, on one node or several)."""

    profilable = False  # the forwards run in the worker processes
    tensors_cross_processes = True

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.node_rank != 0:
            raise ValueError("the front runs on node 0; start other nodes with "
                             "`python -m sangam.engine.multi.node --node-rank R ...`")
        self.config = config
        self.roles = launcher.validate(config)
        self.loaded = _front_model(config, loaded, launcher.worker_device(config, 0))
        # Before any process starts: a model the group cannot split is refused by name.
        data_plane.shard_layout(config).check(self.loaded.config)
        self._closed = False
        self._zygote: subprocess.Popen | None = None
        self._procs: dict[int, launcher.WorkerProcesses] = {}  # this node's workers
        self._workers: dict[int, _WorkerInfo] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 2000)
        # ZeroMQ's own pings (its I/O thread answers them, whatever this thread does): a
        # connection that stops answering is closed, so a worker that comes back after a
        # partition may take its identity again.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 500)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.heartbeat_timeout * 1000))
        self._store: dist.TCPStore | None = None
        self._answers: dict[int, dict[int, str | None]] = {}  # Control answers, by ticket
        self._ray_handles: list = []  # --distributed-executor-backend ray: every rank's actor
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        super().__init__(config, self.loaded, [self._workers[w].hello.num_pages
                                               for w in range(len(self.roles))])
        atexit.register(self.shutdown)

    # Startup and shutdown.
    def _start(self) -> None:
        """Bind the front's socket, open the store (when the workers move tensors), start the
        workers (forked here and by the other nodes' processes, or as Ray actors) and wait
        for each one's Hello."""
        cfg = self.config
        ray = cfg.distributed_executor_backend == "ray"
        address = None
        if ray:  # the workers reach this front at its Ray node's address, on free ports
            from sangam.engine.multi import ray_executor

            host, port = ray_executor.connect(), 0
            self._sock.bind(f"tcp://{host}:*")
            front_addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        elif cfg.dist_init_addr:
            host, port = network.split_addr(cfg.dist_init_addr)
            listen = "*"
            if cfg.nnodes > 1:  # before anything binds: a wrong address is one line
                device = launcher.worker_device(cfg, 0)
                address = network.node_address(cfg, device.split(":")[0])
                listen = network.resolve(host)  # this node's own (checked): only there
            self._sock.bind(f"tcp://{listen}:{port + 1}")
            front_addr = f"tcp://{host}:{port + 1}"
        else:  # one node: loopback, free ports
            host, port = "127.0.0.1", 0
            self._sock.bind("tcp://127.0.0.1:*")
            front_addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        store_addr = None
        if launcher.needs_data_plane(cfg):
            # The front hosts the torch.distributed store (it outlives any worker) but is not
            # a rank: it never touches tensors.
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
            store_addr = (host, self._store.port)
        if ray:
            specs = ray_executor.make_specs(cfg, self.roles, ray_executor.device_type(cfg),
                                            front_addr, store_addr)
            handles = self._ray_handles = ray_executor.start_ray_workers(specs, host)
        else:
            specs = launcher.make_specs(cfg, self.roles, 0, front_addr, store_addr, address)
            self._zygote, handles = launcher.start_local_workers(specs)
        self._procs = launcher.group_by_worker(specs, handles)
        self._await_workers()
        if self._store is not None:  # a node process started from now on cannot join it
            self._store.set(data_plane.SERVING_KEY, "1")

    def _await_workers(self) -> None:
        expect = launcher.signature(tuple(self.roles), self.config, self.loaded.config)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        errors: dict[int, str] = {}
        while len(self._workers) < len(self.roles):
            for w, p in self._procs.items():
                if not p.is_alive():
                    # Its WorkerFailed message may still be in flight: collect it first.
                    self._drain_startup(errors, expect, 200)
                    raise RuntimeError(f"worker {w} failed to start"
                                       + (f":\n{errors[w]}" if w in errors else ""))
            if errors:
                w, err = next(iter(errors.items()))
                raise RuntimeError(f"worker {w} failed to start:\n{err}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(self.roles))) - set(self._workers))
                raise TimeoutError(f"workers {missing} did not come up in {STARTUP_TIMEOUT_S}s "
                                   "(are all nodes started, with the same flags?)")
            self._drain_startup(errors, expect, 100)

    def _drain_startup(self, errors: dict[int, str], expect: tuple, timeout_ms: int) -> None:
        if not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                _, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            m = msg.loads(data)
            if isinstance(m, msg.Hello):
                if m.signature != expect:
                    raise RuntimeError(f"worker {m.worker} disagrees on the deployment: "
                                       f"{m.signature} != {expect} (same flags on every node?)")
                self._workers[m.worker] = _WorkerInfo(m, time.monotonic(), m.num_pages)
            elif isinstance(m, msg.WorkerFailed):
                errors[m.worker] = m.error

    def worker_states(self) -> list[WorkerState]:
        h = [i.hello for _, i in sorted(self._workers.items())]
        return [WorkerState(self.roles[w], w not in self.dead_workers, h[w].pid, h[w].host,
                            h[w].device, h[w].num_pages, h[w].layer_page_bytes,
                            self._workers[w].free_pages, self._workers[w].open_transfers)
                for w in range(len(h))]

    def shutdown(self) -> None:
        """Stop every worker (this node's processes are joined, killed if they linger) and
        release the sockets. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for w in self._workers:
            if w not in self.dead_workers:
                self._send(w, msg.Shutdown())
        for w, p in self._procs.items():
            if w not in self._workers:  # never came up (failed startup): nothing to wait for
                p.kill()
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        for p in self._procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs.values():
            p.kill()  # only those still running
            p.close()
        if self._zygote is not None:  # it exits once its workers are reaped
            try:
                self._zygote.wait(5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
        if self._ray_handles:
            from sangam.engine.multi import ray_executor

            ray_executor.release(self._ray_handles)
        self._sock.close()  # lingers so that remote workers get their Shutdown
        self._ctx.term()
        self._store = None

    @property
    def dead_workers(self) -> list[int]:
        # Before the workers came up (a failed startup shuts down), none has died.
        return self.placement.dead if hasattr(self, "placement") else []

    # The Engine interface (the rest is the front's).
    def step(self) -> list[RequestOutput]:
        """Place waiting blocks, take in the workers' reports (waiting briefly for one when
        there is nothing else to do), and return an output per completed block."""
        self._place()
        self._receive(0 if self._outputs or not self.requests else _POLL_MS)
        self._check_workers()
        self._place()
        return self._take_outputs()

    def watch(self) -> None:
        """Take in the workers' heartbeats and check on them: a worker that dies while the
        engine is idle is declared dead (logged, gauges, failover) within a poll."""
        self._receive(0)
        self._check_workers()

    # Reports.
    def _send(self, w: int, message: object) -> None:
        data = msg.dumps(message)
        self._sock.send_multipart([f"w{w}".encode(), data])
        info = self._workers.get(w)
        if info is not None and not isinstance(message, msg.Shutdown):
            self.counters.count(data)
            info.sent += 1
            # A Control may wait long (for a trainer to join): its answer is awaited, not
            # watched as a loop's progress.
            if info.owes_progress_since is None and not isinstance(message, msg.Control):
                info.owes_progress_since = time.monotonic()

    def _receive(self, timeout_ms: int) -> None:
        if not self._sock.poll(timeout_ms):
            return
        while True:
            try:
                ident, data = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            m = msg.loads(data)
            w = int(ident[1:])
            if isinstance(m, msg.Hello):
                self._on_hello(m)
                continue
            if w in self.dead_workers or w not in self._workers:
                continue  # whatever it said before dying was taken back
            self._workers[w].last_heard = time.monotonic()
            if isinstance(m, msg.Report):
                self.counters.count(data)
                self._on_worker_report(m)
            elif isinstance(m, msg.Heartbeat):
                self._on_heartbeat(self._workers[w], m)
            elif isinstance(m, msg.WorkerFailed):
                self._on_dead(w, f"it failed:\n{m.error}")

    @staticmethod
    def _on_heartbeat(info: _WorkerInfo, beat: msg.Heartbeat) -> None:
        now = time.monotonic()
        if beat.loop_cpu_s is None:
            return
        if info.loop_cpu is not None:
            then, cpu = info.loop_cpu
            if beat.loop_cpu_s - cpu >= COMPUTING_CPU_SHARE * (now - then):
                info.computing_at = now
        info.loop_cpu = (now, beat.loop_cpu_s)

    def _on_worker_report(self, r: msg.Report) -> None:
        done = [ev for ev in r.events if isinstance(ev, msg.ControlDone)]
        if done:
            for ev in done:
                self._answers.setdefault(ev.ticket, {})[r.worker] = ev.error
            r.events = [ev for ev in r.events if not isinstance(ev, msg.ControlDone)]
        info = self._workers[r.worker]
        info.free_pages, info.open_transfers = r.free_pages, r.open_transfers
        owes = r.busy or r.handled < info.sent
        info.owes_progress_since = time.monotonic() if owes else None
        self._on_report(r.worker, r.events, r.iterations)

    def _run_control(self, m: msg.Control) -> None:
        """Send ``m`` to every live worker and wait for each one's answer (a worker that dies
        meanwhile is taken out, as always). Workers that refused it while others ran it would
        serve different weights: they are declared dead."""
        live = [w for w in range(len(self.roles)) if w not in self.dead_workers]
        for w in live:
            self._send(w, m)
        answers = self._answers.setdefault(m.ticket, {})
        while set(live) - set(answers) - set(self.dead_workers):
            self._receive(_POLL_MS)
            self._check_workers()
        answers = {w: e for w, e in self._answers.pop(m.ticket).items()
                   if w not in self.dead_workers}
        refused = {w: e for w, e in answers.items() if e is not None}
        if refused and len(refused) < len(answers):
            for w in refused:
                self._on_dead(w, f"it refused {m.op} that the other workers ran: "
                                 f"{refused[w]}")
        if refused and len(refused) == len(answers):
            raise ControlRefused(next(iter(refused.values())))
        if not answers:
            raise RuntimeError(f"{m.op}: no worker is alive")

    # What a caller may ask of any engine.
    def _describe_workers(self) -> list[str]:
        tp = self.config.tensor_parallel_size
        ranks = f" of {tp} ranks each (tensor parallel)" if tp > 1 else ""
        return [f"{self.config.mode} over {len(self.worker_states())} workers{ranks}"]

    def gauges(self) -> list[Gauge]:
        """(name, help, value) of every live gauge: the pools of the live workers, summed as
        they last reported them."""
        live = [w for w in self.worker_states() if w.alive]
        pages = sum(w.num_pages for w in live)
        used = pages - sum(w.free_pages for w in live)
        return [
            ("sangam_requests_in_flight", "Requests accepted and not finished",
             self.num_requests),
            ("sangam_kv_pool_usage_ratio", "Fraction of KV pages in use",
             used / pages if pages else 0.0),
            ("sangam_kv_pool_pages_used", "KV pages in use", used),
            ("sangam_kv_pool_pages", "KV pages in the pool", pages),
            ("sangam_workers_alive", "Worker processes alive", len(live)),
        ]

    # Failures.
    def _check_workers(self) -> None:
        now = time.monotonic()
        for w, info in self._workers.items():
            if w in self.dead_workers:
                continue
            p = self._procs.get(w)
            since = info.owes_progress_since
            timeout = self.config.watchdog_timeout
            if p is not None and not p.is_alive():
                self._on_dead(w, "its process exited")
            elif p is None and now - info.last_heard > self.config.heartbeat_timeout:
                self._on_dead(w, f"no heartbeat for {now - info.last_heard:.1f}s "
                                 "(--heartbeat-timeout): its node is down or cut off")
            elif since is not None and now - max(since, info.computing_at) > timeout:
                # Alive (its heartbeat thread may still run) but its loop is stuck, e.g. in a
                # blocking call. A loop merely waiting on a slow peer keeps reporting.
                self._on_dead(w, f"hung: its loop has not reported for {now - since:.0f}s "
                                 "with work to do, and is not computing (--watchdog-timeout)")
            elif since is not None and now - since > BUSY_SILENCE_FACTOR * timeout:
                self._on_dead(w, f"hung: its loop has computed for {now - since:.0f}s without "
                                 f"a report ({BUSY_SILENCE_FACTOR:g} x --watchdog-timeout)")

    def _on_hello(self, m: msg.Hello) -> None:
        """A worker said Hello after startup: one of another node that was declared dead and
        whose node process came back. It serves again if nothing it would lack changed: it
        loaded the checkpoint, so not after a weight update; and no process group can take
        a new rank, so only where there is none (node.py refuses the others up front)."""
        w = m.worker
        why = None
        if w not in self.dead_workers or w in self._procs:
            why = "a worker of that number is alive (two nodes with one --node-rank?)"
        elif m.signature != launcher.signature(tuple(self.roles), self.config,
                                               self.loaded.config):
            why = "it disagrees on the deployment (same flags on every node?)"
        elif self.weights_version or self.released:
            why = (f"the weights were updated in place (version {self.weights_version}) or "
                   "released since it loaded the checkpoint")
        if why is not None:
            logger.error("worker %d (pid %d on %s) may not rejoin: %s", w, m.pid, m.host, why)
            if w in self.dead_workers:  # else its identity is the live worker's
                self._send(w, msg.Shutdown())
            return
        self._workers[w] = _WorkerInfo(m, time.monotonic(), m.num_pages)
        self.core.worker_rejoined(w, m.num_pages)
        logger.warning("worker %d (%s, pid %d on %s) rejoined with %d KV pages", w,
                       self.roles[w], m.pid, m.host, m.num_pages)

    def _on_dead(self, w: int, why: str) -> None:
        logger.error("worker %d (%s, pid %d on %s) is dead: %s; its requests are taken back",
                     w, self.roles[w], self._workers[w].hello.pid,
                     self._workers[w].hello.host, why)
        # It may still run (it failed, its heartbeats were late, its loop hung): nothing it
        # does counts now, and it must exit. A local worker is killed here; one on another node
        # is told to by its heartbeat thread, which runs even when the loop is stuck.
        self._send(w, msg.Shutdown())
        p = self._procs.get(w)
        if p is not None:
            p.kill()
        else:
            self._sock.send_multipart([f"h{w}".encode(), msg.dumps(msg.Kill())])
        self._take_back(w)  # raises when no worker is left
