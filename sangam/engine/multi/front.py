"""``MultiWorkerEngine``: the front process of multi-worker serving (DESIGN.md §4, Modes).

It has the single-worker ``Engine``'s interface (``add_request`` / ``abort_request`` /
``step`` / ``has_unfinished_requests`` / ``requests`` / ``stats``), so ``LLM`` and
``AsyncEngine`` drive either. It holds the Router and the request table and never touches the
model: per request it keeps the ``DecodeState`` as of the start of the block to run next (a
token array), which is all that recovery needs, because a block's refresh recomputes every
layer's K/V of every position from the tokens alone.

Who runs what (the worker's side is in ``worker.py``):
- colocated: each block runs where the request's canvas is (the router keeps re-prefills
  there); the first goes to the least-loaded worker.
- disaggregated / hybrid: a new canvas is placed on the decode worker with the most free pages
  (``route_decode``; the request waits here while none has room); each block's refresh goes to
  a prefill worker by load (``route_prefill``), which applies the refresh's unmasking step and
  ships the K/V and the state to the canvas holder; the holder runs the cached steps. Hybrid
  overflow (``route_prefill`` returns a decode worker) runs the whole block there, on the
  canvas, with nothing to ship.
- ``cache="none"`` requests in disaggregated / hybrid mode: every step is a refresh, so there
  is no cache worth shipping. Each block runs entirely where ``route_prefill`` puts it (a
  prefill worker, or a decode worker on overflow) on pages held for that block only; decode
  workers keep running cached steps only.
- Failover: when only prefill workers or only decode workers survive (``one_role_left``), the
  survivors serve as colocated workers (each block runs whole where its canvas is), so any
  subset of workers that is not empty keeps serving. With none left, ``step`` raises.

Memory: the front mirrors every worker's page commitments (canvases held or promised, pages of
refreshes for other workers) to give the router free-page counts that do not lag behind.

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
import contextlib
import itertools
import logging
import random
import subprocess
import time
from collections import deque
from collections.abc import Iterator
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
from sangam.sched.request import Request
from sangam.sched.router import Router

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

PENDING = "pending"  # at the front, waiting to be placed
RUNNING = "running"  # ``worker`` runs this block's refresh (and, without kv_dst, the block)
TRANSFER = "transfer"  # the refresh's K/V travels from kv_src to kv_dst


@dataclass
class _Entry:
    request: Request  # the router's view; pages/worker mirror the canvas holder's
    state: DecodeState  # at the start of the next block to run (or finished)
    prompt_ids: list[int]
    pages_needed: int
    attempt: int  # unique over the engine's life: a reused request id never matches old news
    phase: str = PENDING
    worker: int | None = None
    holder: int | None = None  # holds (or, once admitted there, will hold) the canvas
    reserved: int | None = None  # decode worker promised the canvas on K/V receipt
    kv_src: int | None = None
    kv_dst: int | None = None
    load_worker: int | None = None  # router load outstanding there
    kv_bytes: int = 0
    kv_transfers: int = 0
    restarts: int = 0
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
    overflow_prefills: int = 0  # hybrid: prefills placed on decode workers
    kv_transfers: int = 0
    kv_bytes: int = 0
    failed_transfers: int = 0
    restarts: int = 0  # requests taken back to their block start
    prefills_by_worker: dict[int, int] = field(default_factory=dict)


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
        self.requests: dict[str, _Entry] = {}
        self.stats = EngineStats()
        self.counters = Counters()
        self.transfers: deque[TransferRecord] = deque(maxlen=100_000)
        self.dead_workers: list[int] = []
        self._rng = random.Random(config.seed)
        self._attempts = itertools.count()
        self._pending: dict[str, _Entry] = {}
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
        n = len(self.roles)
        self._num_pages = [self._workers[w].hello.num_pages for w in range(n)]
        self._committed = [0] * n
        self.router = Router(config.mode, self.roles, config.overflow_threshold, config.seed,
                             config.page_size)
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
        need = req.pages_needed(self.config.page_size)
        self._check_fits(need, state.total_len)
        entry = _Entry(req, state, state.prompt_ids(), need, next(self._attempts))
        self.requests[request_id] = entry
        self._pending[request_id] = entry

    def _check_fits(self, need: int, tokens: int) -> None:
        def biggest(workers: list[int]) -> int:
            return max((self._num_pages[w] for w in workers), default=0)

        room = min(biggest(self.router.prefill_capable()), biggest(self.router.canvas_capable()))
        if need > room:
            raise RequestRejected(f"request needs {need} KV pages for {tokens} tokens, more "
                                  f"than the pool's {room}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        e = self.requests.pop(request_id, None)
        if e is None:
            return None
        self._release(e)
        self._pending.pop(request_id, None)
        return self._output(e, finished=True, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Place waiting blocks, take in the workers' reports (waiting briefly for one when
        there is nothing else to do), and return an output per completed block."""
        self._place_pending()
        self._receive(0 if self._outputs or not self.requests else _POLL_MS)
        self._check_workers()
        self._place_pending()
        out, self._outputs = self._outputs, []
        return out

    # Placement.
    def _free_pages(self) -> list[int]:
        return [0 if w in self.dead_workers else self._num_pages[w] - self._committed[w]
                for w in range(len(self.roles))]

    def _footprint(self, e: _Entry) -> list[tuple[int, int]]:
        canvas = e.holder if e.holder is not None else e.reserved
        out = [] if canvas is None else [(canvas, e.pages_needed)]
        if e.phase == RUNNING and e.worker != canvas:  # pages for this block only
            out.append((e.worker, e.pages_needed))
        return out

    @contextlib.contextmanager
    def _moving(self, e: _Entry) -> Iterator[None]:
        """Keep the page mirror in step with the entry's placement fields."""
        for w, n in self._footprint(e):
            self._committed[w] -= n
        yield
        for w, n in self._footprint(e):
            self._committed[w] += n

    def _place_pending(self) -> None:
        blocked = False
        for e in sorted(self._pending.values(), key=lambda e: e.request.queue_key):
            # A new canvas that finds no decode memory blocks later new canvases (strict
            # priority); blocks of requests that hold their canvas never wait for memory.
            needs_canvas = e.holder is None and self.config.mode != "colocated" \
                and e.request.cache != "none" and not self.router.one_role_left
            if not (blocked and needs_canvas) and self._place(e):
                del self._pending[e.request.request_id]
            else:
                blocked = blocked or needs_canvas

    def _place(self, e: _Entry) -> bool:
        req = e.request
        free = self._free_pages()
        if self.config.mode == "colocated" or (self.router.one_role_left
                                               and req.cache != "none"):
            w = self.router.route_prefill(req, free)
            self._dispatch(e, w, None, keep=True, holder=w)
        elif req.cache == "none":
            self._dispatch(e, self.router.route_prefill(req, free), None, keep=False)
        else:
            dest = e.holder
            if dest is None:
                dest = self.router.route_decode(req, free, e.pages_needed)
                if dest is None:
                    return False
            w = self.router.route_prefill(req, free)
            if self.roles[w] == "decode":  # hybrid overflow: the block runs on its canvas
                self.counters.overflow_prefills += 1
                self._dispatch(e, w, None, keep=True, holder=w)
            else:
                self._dispatch(e, w, dest, keep=False, holder=e.holder,
                               reserved=dest if e.holder is None else None)
        return True

    def _dispatch(self, e: _Entry, w: int, kv_dest: int | None, keep: bool,
                  holder: int | None = None, reserved: int | None = None) -> None:
        with self._moving(e):
            e.phase, e.worker, e.holder, e.reserved = RUNNING, w, holder, reserved
            e.load_worker = w  # route_prefill charged the refresh to w
        c = self.counters.prefills_by_worker
        c[w] = c.get(w, 0) + 1
        self._send(w, msg.Prefill(e.request.request_id, e.attempt, e.state,
                                  e.request.arrival_time, kv_dest, keep))

    def _release(self, e: _Entry) -> None:
        """Drop ``e`` from every live worker that may hold part of it; clear its placement."""
        rid = e.request.request_id
        for w in {e.worker, e.holder, e.kv_dst} - {None}:
            if w not in self.dead_workers:
                self._send(w, msg.Drop(rid))
        if e.load_worker is not None:
            self.router.done(e.load_worker, e.request.prefill_cost)
        with self._moving(e):
            e.phase = PENDING
            e.worker = e.holder = e.reserved = e.kv_src = e.kv_dst = e.load_worker = None
        e.request.pages, e.request.worker = [], None

    def _restart(self, e: _Entry, why: str) -> None:
        """Take ``e`` back to the start of its current block and place it again."""
        logger.info("request %s restarts block %d: %s", e.request.request_id, e.state.block, why)
        self._release(e)
        e.attempt = next(self._attempts)
        e.restarts += 1
        self.counters.restarts += 1
        self._pending[e.request.request_id] = e

    # Reports.
    def _send(self, w: int, message: object) -> None:
        self._sock.send_multipart([f"w{w}".encode(), msg.dumps(message)])
        info = self._workers.get(w)
        if info is not None and not isinstance(message, msg.Shutdown):
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
            current = e is not None and ev.attempt == e.attempt
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
        if e.load_worker == w:
            self.router.done(w, e.request.prefill_cost)
            e.load_worker = None
        now = time.monotonic()
        m = e.request.metrics
        m.prefill_started.append(now - ev.seconds)
        m.prefill_finished.append(now)

    def _on_kv_sent(self, w: int, ev: msg.KVSent, e: _Entry | None) -> None:
        drain = e is None or ev.drain
        record = TransferRecord(ev.request_id, w, ev.dest, ev.num_pages, ev.nbytes,
                                ev.streamed_layers, drain)
        self.transfers.append(record)
        if ev.dest in self.dead_workers:
            return  # the sender abandons it (PeerDead); the request was taken back
        self._open_transfers[(w, ev.transfer_id)] = record
        arrival = e.request.arrival_time if e is not None else 0.0
        self._send(ev.dest, msg.ReceiveKV(ev.request_id, ev.attempt, w, ev.transfer_id,
                                          ev.num_pages, None if drain else ev.state, arrival,
                                          drain))
        if drain:
            return
        with self._moving(e):
            e.phase, e.worker, e.kv_src, e.kv_dst = TRANSFER, None, w, ev.dest
        e.kv_bytes += ev.nbytes
        e.kv_transfers += 1
        self.counters.kv_transfers += 1
        self.counters.kv_bytes += ev.nbytes

    def _on_kv_received(self, w: int, ev: msg.KVReceived, e: _Entry) -> None:
        if not ev.ok:
            self.counters.failed_transfers += 1
            self._restart(e, f"K/V transfer {ev.src} -> {w} failed")
            return
        with self._moving(e):
            e.phase, e.worker, e.holder, e.reserved = RUNNING, w, w, None
            e.kv_src = e.kv_dst = None
        e.request.pages, e.request.worker = list(ev.pages), w

    def _on_block_done(self, w: int, ev: msg.BlockDone, e: _Entry) -> None:
        now = time.monotonic()
        e.state = ev.state
        m = e.request.metrics
        m.block_finished.append(now)
        m.num_steps = ev.state.num_forwards
        rid = e.request.request_id
        if ev.state.finished:
            for other in {e.holder, e.kv_dst} - {None, w}:  # a canvas left elsewhere
                if other not in self.dead_workers:
                    self._send(other, msg.Drop(rid))
            with self._moving(e):
                e.phase, e.worker, e.holder, e.reserved = PENDING, None, None, None
            del self.requests[rid]
            m.finish_time = now
            self.stats.finished.append(m)
            self._outputs.append(self._output(e, True, ev.state.finish_reason))
            return
        with self._moving(e):
            e.phase, e.worker, e.reserved = PENDING, None, None
            if ev.pages:
                e.holder = w
        if ev.pages:
            e.request.pages, e.request.worker = list(ev.pages), w
        e.request.block = ev.state.block
        m.prefill_queued.append(now)
        self._pending[rid] = e
        self._outputs.append(self._output(e, False, None))

    def _on_request_failed(self, ev: msg.RequestFailed, e: _Entry) -> None:
        rid = e.request.request_id
        logger.error("request %s failed and was ended: %s", rid, ev.error)
        self._release(e)
        self._pending.pop(rid, None)
        del self.requests[rid]
        self._outputs.append(self._output(e, True, "error", ev.error))

    def _output(self, e: _Entry, finished: bool, reason: str | None,
                error: str | None = None) -> RequestOutput:
        return self.loaded.output(e.request.request_id, e.prompt_ids, e.state, finished, reason,
                                  {"kv_bytes": e.kv_bytes, "kv_transfers": e.kv_transfers,
                                   "restarts": e.restarts,
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
        self.dead_workers.append(w)
        self.router.mark_dead(w)
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
        for other in self._workers:
            if other not in self.dead_workers:
                self._send(other, msg.PeerDead(w))
        for e in list(self.requests.values()):
            if w in (e.worker, e.holder, e.reserved, e.kv_src, e.kv_dst):
                self._restart(e, f"worker {w} died")
        if not any(w2 not in self.dead_workers for w2 in range(len(self.roles))):
            raise RuntimeError("every worker is dead")

