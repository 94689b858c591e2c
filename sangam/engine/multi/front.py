"""``MultiWorkerEngine``: the front process of multi-worker serving (DESIGN.md §4, Modes).

It has the single-worker ``Engine``'s interface (``add_request`` / ``abort_request`` /
``step`` / ``has_unfinished_requests`` / ``requests`` / ``stats``), so ``LLM`` and
``AsyncEngine`` drive either. It holds the Router and the request table and never touches the
model: per request it keeps the ``DecodeState`` as of the start of the block to run next (a
token array), which is all that recovery needs, because a block's refresh recomputes every
layer's K/V of every position from the tokens alone.

Where each block runs, when K/V moves and what a failure takes back is ``Placement``'s
(``sangam/sched/placement.py``), which the simulator drives too: this process turns its
decisions into messages to the workers and the workers' reports into its events.

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
import random
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import zmq

from sangam.config import EngineConfig
from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.engine.engine import EngineStats, RequestRejected, new_request, tokens_per_forward
from sangam.engine.loaded_model import LoadedModel, checkpoint_path
from sangam.engine.multi import launcher
from sangam.engine.multi import messages as msg
from sangam.models import read_config, resolve_dtype
from sangam.sampling_params import RequestOutput, SamplingParams
from sangam.sched.placement import NeverFits, Placed, Placement

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # model loading on every worker of every node
HEARTBEAT_TIMEOUT_S = 30.0  # workers on other nodes (local ones are watched by their process)
# A loop whose thread used this share of a core between two heartbeats is computing (one long
# forward or K/V gather), not stuck in a wait; but a wedged device can keep a thread spinning,
# so a computing loop that does not report is declared hung after this many watchdog timeouts.
COMPUTING_CPU_SHARE = 0.1
BUSY_SILENCE_FACTOR = 10.0
_POLL_MS = 10  # step() waits this long for a worker report when there is nothing to return
_SHUTDOWN_WAIT_S = 10.0

@dataclass
class _Entry:
    placed: Placed  # where it is (Placement's)
    state: DecodeState  # at the start of the next block to run (or finished)
    prompt_ids: list[int]
    kv_bytes: int = 0
    kv_transfers: int = 0
    # The worker that parked the canvas with a copy of ``state`` (it ended the last block
    # there and has not been sent the request since): it is sent no state, only progress.
    parked_on: int | None = None
    text: IncrementalDetokenizer = field(init=False)  # the outputs' text

    def __post_init__(self) -> None:
        self.text = IncrementalDetokenizer(self.state.params.skip_special_tokens)


@dataclass
class TransferRecord:
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


@dataclass
class Counters:
    kv_transfers: int = 0
    kv_bytes: int = 0
    blocks: int = 0  # blocks completed
    # The control plane, both ways (heartbeats aside): what moving requests between workers
    # costs beyond their K/V.
    control_messages: int = 0
    control_bytes: int = 0

    def count(self, data: bytes) -> None:
        self.control_messages += 1
        self.control_bytes += len(data)


def _front_model(config: EngineConfig, loaded: LoadedModel | None,
                 device: str) -> LoadedModel:
    """Tokenizer, stop tokens and request validation without weights (``model=None``): the
    workers hold the model."""
    if loaded is not None:
        return loaded
    path = checkpoint_path(config)
    dtype = resolve_dtype(None if config.dtype == "auto" else config.dtype, device)
    return LoadedModel.around(config, path, None, read_config(path), torch.device(device), dtype)


class MultiWorkerEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if config.node_rank != 0:
            raise ValueError("the front runs on node 0; start other nodes with "
                             "`python -m sangam.engine.multi.node --node-rank R ...`")
        self.config = config
        self.roles = launcher.validate(config)
        self.loaded = _front_model(config, loaded, launcher.worker_device(config, 0))
        if self.loaded.config.block_causal:
            raise ValueError("a block-causal model (SDAR) is served by one worker process for "
                             "now: drop --num-workers / --mode / --nnodes")
        self.requests: dict[str, _Entry] = {}
        self.stats = EngineStats()
        self.counters = Counters()
        self.transfers: deque[TransferRecord] = deque(maxlen=100_000)
        self._rng = random.Random(config.seed)
        self._outputs: list[RequestOutput] = []
        self._open_transfers: dict[tuple[int, int], TransferRecord] = {}
        self._closed = False
        self._zygote: subprocess.Popen | None = None
        self._procs: dict[int, launcher.ProcessHandle] = {}  # this node's workers
        self._workers: dict[int, _WorkerInfo] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._store: dist.TCPStore | None = None
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        self.placement = Placement(
            config.mode, self.roles, [self._workers[w].hello.num_pages
                                      for w in range(len(self.roles))],
            config.page_size, config.overflow_threshold, config.seed)
        atexit.register(self.shutdown)

    # Startup and shutdown.
    def _start(self) -> None:
        cfg = self.config
        if cfg.dist_init_addr:
            host, port = launcher.split_addr(cfg.dist_init_addr)
            self._sock.bind(f"tcp://*:{port + 1}")
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
        specs = launcher.make_specs(cfg, self.roles, 0, front_addr, store_addr)
        self._zygote, handles = launcher.start_local_workers(specs)
        self._procs = {s.worker: h for s, h in zip(specs, handles)}
        self._await_workers()

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
        self._sock.close()  # lingers so that remote workers get their Shutdown
        self._ctx.term()
        self._store = None

    # The Engine interface.
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None,
                    suffix_token_ids: list[int] = ()) -> None:
        """Validate and queue a request (with ``suffix_token_ids``: an infill between prompt
        and suffix); raises (and changes nothing) if it cannot be served."""
        req, state = new_request(self.requests, self.config, self.loaded, self._rng, request_id,
                                 prompt_token_ids, params, arrival_time, suffix_token_ids)
        try:
            placed = self.placement.add(req)
        except NeverFits as e:
            raise RequestRejected(str(e)) from None
        self.requests[request_id] = _Entry(placed, state, state.prompt_ids())

    @property
    def dead_workers(self) -> list[int]:
        return self.placement.dead

    def abort_request(self, request_id: str) -> RequestOutput | None:
        e = self.requests.pop(request_id, None)
        if e is None:
            return None
        self._drop(request_id, self.placement.remove(request_id))
        return self._output(e, finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Place waiting blocks, take in the workers' reports (waiting briefly for one when
        there is nothing else to do), and return an output per completed block."""
        self._place()
        self._receive(0 if self._outputs or not self.requests else _POLL_MS)
        self._check_workers()
        self._place()
        out, self._outputs = self._outputs, []
        return out

    # Placement's decisions, as messages.
    def _place(self) -> None:
        for d in self.placement.place():
            e = self.requests[d.request_id]
            r = e.placed.request
            e.state.force_refresh = r.force_refresh  # taken back: its block refreshes fully
            self._send(d.worker, msg.Prefill(d.request_id, d.attempt, self._state_for(e, d.worker),
                                             r.arrival_time, r.seq, d.kv_dest, d.keep_pages))

    @staticmethod
    def _state_for(e: _Entry, w: int) -> DecodeState | None:
        """What ``w`` is sent of the request's state: none if it parked a copy (which the
        message then takes out of parking), else the snapshot."""
        if e.parked_on == w:
            e.parked_on = None
            return None
        return e.state

    def _drop(self, request_id: str, workers: set[int]) -> None:
        e = self.requests.get(request_id)
        if e is not None and e.parked_on in workers:
            e.parked_on = None
        for w in workers:
            self._send(w, msg.Drop(request_id))

    # Reports.
    def _send(self, w: int, message: object) -> None:
        data = msg.dumps(message)
        self._sock.send_multipart([f"w{w}".encode(), data])
        info = self._workers.get(w)
        if info is not None and not isinstance(message, msg.Shutdown):
            self.counters.count(data)
            info.sent += 1
            if info.owes_progress_since is None:
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
            if w in self.dead_workers or w not in self._workers:
                continue  # whatever it said before dying was taken back
            self._workers[w].last_heard = time.monotonic()
            if isinstance(m, msg.Report):
                self.counters.count(data)
                self._on_report(m)
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

    def _on_report(self, r: msg.Report) -> None:
        w = r.worker
        info = self._workers[w]
        info.free_pages, info.open_transfers = r.free_pages, r.open_transfers
        owes = r.busy or r.handled < info.sent
        info.owes_progress_since = time.monotonic() if owes else None
        self.stats.iterations.extend(r.iterations)
        for ev in r.events:
            e = self.requests.get(ev.request_id)
            current = e is not None and ev.attempt == e.placed.attempt
            if isinstance(ev, msg.KVReceived):
                record = self._open_transfers.pop((ev.src, ev.transfer_id), None)
                if record is not None:
                    record.bytes_received, record.ok = ev.nbytes, ev.ok
                    current = current and not record.drained
            if isinstance(ev, msg.KVSent):
                self._on_kv_sent(w, ev, e if current else None)
            elif not current:
                continue  # about work that was taken back or aborted
            elif isinstance(ev, msg.RefreshRan):
                self._on_refresh(w, ev, e)
            elif isinstance(ev, msg.KVReceived):
                self._on_kv_received(w, ev, e)
            elif isinstance(ev, msg.BlockDone):
                self._on_block_done(w, ev, e)
            elif isinstance(ev, msg.RequestFailed):
                self._on_request_failed(ev, e)

    def _on_refresh(self, w: int, ev: msg.RefreshRan, e: _Entry) -> None:
        now = time.monotonic()
        self.placement.refreshed(e.placed, w, now - ev.seconds, now)

    def _on_kv_sent(self, w: int, ev: msg.KVSent, e: _Entry | None) -> None:
        drain = self.placement.kv_sent(None if e is None else e.placed, w, ev.dest, ev.drain)
        record = TransferRecord(ev.request_id, w, ev.dest, ev.num_pages, ev.nbytes,
                                ev.streamed_layers, drain)
        self.transfers.append(record)
        if ev.dest in self.dead_workers:
            return  # the sender abandons it (PeerDead); the request was taken back
        self._open_transfers[(w, ev.transfer_id)] = record
        arrival, seq = ((e.placed.request.arrival_time, e.placed.request.seq) if e is not None
                        else (0.0, 0))
        state, progress = (None, None) if drain else (self._state_for(e, ev.dest), ev.progress)
        self._send(ev.dest, msg.ReceiveKV(ev.request_id, ev.attempt, w, ev.transfer_id,
                                          ev.num_pages, state, progress, arrival, seq, drain))
        if drain:
            return
        e.kv_bytes += ev.nbytes
        e.kv_transfers += 1
        self.counters.kv_transfers += 1
        self.counters.kv_bytes += ev.nbytes

    def _on_kv_received(self, w: int, ev: msg.KVReceived, e: _Entry) -> None:
        if not ev.ok:
            logger.info("request %s restarts block %d: K/V transfer %d -> %d failed",
                        ev.request_id, e.state.block, ev.src, w)
        self._drop(ev.request_id, self.placement.kv_received(e.placed, w, ev.ok, ev.pages))

    def _on_block_done(self, w: int, ev: msg.BlockDone, e: _Entry) -> None:
        e.state.catch_up(ev.progress)
        st = e.state
        rid = ev.request_id
        if ev.continues:  # the next block runs on where the canvas is: nothing to place
            self.placement.block_continued(e.placed, st.block, st.num_forwards,
                                           time.monotonic())
        else:
            e.parked_on = w if ev.pages else None
            e.placed.request.force_refresh = st.force_refresh  # placed as the full refresh it is
            self._drop(rid, self.placement.block_done(e.placed, w, st.finished, st.block,
                                                      st.num_forwards, list(ev.pages),
                                                      time.monotonic()))
        self.counters.blocks += 1
        if st.finished:
            del self.requests[rid]
            self.stats.finished.append(e.placed.request.metrics)
        self._outputs.append(self._output(e, st.finished, st.finish_reason))

    def _on_request_failed(self, ev: msg.RequestFailed, e: _Entry) -> None:
        rid = ev.request_id
        logger.error("request %s failed and was ended: %s", rid, ev.error)
        del self.requests[rid]
        self._drop(rid, self.placement.remove(rid))
        self._outputs.append(self._output(e, True, "error", ev.error))

    def _output(self, e: _Entry, finished: bool, reason: str | None,
                error: str | None = None) -> RequestOutput:
        return self.loaded.output(e.placed.request_id, e.prompt_ids, e.state, finished, reason,
                                  {"kv_bytes": e.kv_bytes, "kv_transfers": e.kv_transfers,
                                   "restarts": e.placed.restarts,
                                   "num_refreshes": len(e.placed.request.metrics.prefill_started),
                                   "tokens_per_forward": tokens_per_forward(e.state)}, e.text,
                                  error)

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
            elif p is None and now - info.last_heard > HEARTBEAT_TIMEOUT_S:
                self._on_dead(w, f"no heartbeat for {now - info.last_heard:.0f}s")
            elif since is not None and now - max(since, info.computing_at) > timeout:
                # Alive (its heartbeat thread may still run) but its loop is stuck, e.g. in a
                # blocking call. A loop merely waiting on a slow peer keeps reporting.
                self._on_dead(w, f"hung: its loop has not reported for {now - since:.0f}s "
                                 "with work to do, and is not computing (--watchdog-timeout)")
            elif since is not None and now - since > BUSY_SILENCE_FACTOR * timeout:
                self._on_dead(w, f"hung: its loop has computed for {now - since:.0f}s without "
                                 f"a report ({BUSY_SILENCE_FACTOR:g} x --watchdog-timeout)")

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
        for key, record in list(self._open_transfers.items()):
            if record.dst == w:  # its report will never come
                record.ok = False
                del self._open_transfers[key]
        for e in self.requests.values():
            if e.parked_on == w:
                e.parked_on = None
        taken = self.placement.worker_dead(w)  # raises when none is left
        for other in self._workers:
            if other not in self.dead_workers:
                self._send(other, msg.PeerDead(w))
        for placed, drops in taken:
            logger.info("request %s restarts block %d: worker %d died", placed.request_id,
                        placed.request.block, w)
            self._drop(placed.request_id, drops)
