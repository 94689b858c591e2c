"""``AsyncEngine``: the engine for other servers (docs/design.md §3).

The Engine runs in one background thread, which alone touches the model and the scheduler;
callers on an asyncio loop hand it requests and aborts through a queue and receive one
RequestOutput per committed block. A forward never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from sangam.config import EngineConfig
from sangam.engine.front import check_queue
from sangam.engine.heap import HeapTrimmer
from sangam.engine.interface import Gauge, SteppedEngine
from sangam.engine.loaded_model import LoadedModel
from sangam.engine.multi import make_engine
from sangam.engine.profiler import MAX_PROFILED_STEPS, EngineProfiler
from sangam.sampling_params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """A request ended by a failure in the engine (its pages are freed; others go on)."""


class EngineDead(RuntimeError):
    """The engine loop failed: no request can run any more (the server exits)."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand ``item`` to the caller's loop; False when that loop is closed (nobody will
        ever read this stream)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class AsyncEngine:
    """Invariants: only the engine thread touches ``engine``; every command is either queued
    before the thread stops reading (and answered) or refused; a request whose caller left
    (its generator closed, its accept future cancelled) is aborted, whatever moment it left
    at; ``open_requests`` counts the callers' generators that may still hold a request, so an
    overloaded engine refuses new ones (QueueFull) without a trip through the engine thread; a
    weight or memory operation runs only when no request is in flight, and a request submitted
    after it (or during a pause) starts only after it ran (or the pause ended)."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 **engine_options):
        self.config = config or EngineConfig.from_options(**engine_options)
        self.engine: SteppedEngine = make_engine(self.config, loaded)
        self.loaded = self.engine.loaded
        self.profilable = self.engine.profilable
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._profiler: EngineProfiler | None = None  # touched by the engine thread only
        # Set, under the lock, once the engine thread reads no more commands: a command is
        # either queued before (and answered) or refused, never left waiting.
        self._closing = threading.Lock()
        self._closed = False
        self.open_requests = 0  # callers' generators between submission and their end
        self._count_lock = threading.Lock()  # callers may run on several event loops
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self.dead: BaseException | None = None  # set before the thread can fail
        # Weight updates and memory operations wait (in order) for the requests in flight to
        # finish on the weights they started with; requests that arrive meanwhile, or while
        # generation is paused, wait (``_held``) and start after them.
        self._heap = HeapTrimmer()  # resident memory stays flat over long runs
        self._barriers: collections.deque[tuple] = collections.deque()
        self._held: collections.deque[tuple] = collections.deque()
        self.paused = False
        self._thread = threading.Thread(target=self._loop, name="sangam-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.loaded.text.tokenizer

    def describe(self) -> str:
        """One line on what serves (the engine's ``describe``)."""
        return self.engine.describe()

    def gauges(self) -> list[Gauge]:
        """The engine's live gauges (read from any thread: plain attribute reads)."""
        return self.engine.gauges()

    @property
    def stats(self):
        return self.engine.stats

    async def get_tokenizer(self):
        """The checkpoint's tokenizer (None without one), as vLLM's ``AsyncLLM``."""
        return self.engine.loaded.text.tokenizer

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None,
                       suffix: str | list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield one output per committed block; the last has ``finished=True``. Raises
        ValueError (or RequestRejected / QueueFull) at once for a request that cannot run,
        RequestFailed if it fails in the engine, EngineDead if the engine loop has failed.
        Leaving the loop early (or cancelling the task at any point) aborts the request and
        frees its pages. With a ``suffix`` the response fills the gap between prompt and
        suffix (infilling). Text is tokenized off the event loop."""
        self._check_alive()
        with self._count_lock:
            check_queue(self.open_requests, self.config.max_queue_len)  # refused here: fast
            self.open_requests += 1
        request_id = request_id or uuid.uuid4().hex
        accepted: concurrent.futures.Future | None = None  # None: nothing submitted yet
        finished = False
        try:
            loaded = self.engine.loaded
            ids = (await asyncio.to_thread(loaded.text.encode, prompt) if isinstance(prompt, str)
                   else list(prompt))
            # The suffix continues the text: no special tokens (BOS) of its own.
            tail = (await asyncio.to_thread(loaded.text.encode, suffix, False)
                    if isinstance(suffix, str) else list(suffix or ()))
            stream = _Stream(asyncio.get_running_loop())
            accepted = concurrent.futures.Future()
            self._submit(("add", request_id, ids, tail, params, stream, accepted))
            try:
                await asyncio.wrap_future(accepted)  # the engine's validation error, if any
            except Exception:
                finished = True  # refused: there is nothing to abort (the id may be another's)
                raise
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.finish_reason == "error":
                    raise RequestFailed(item.error)
                yield item
        finally:
            with self._count_lock:
                self.open_requests -= 1
            # The caller left (or the engine failed) once the engine may have added it. A
            # cancel that reached the future first means the engine thread never will.
            if not finished and accepted is not None and not accepted.cancelled():
                self._post(("abort", request_id))

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once the engine loop has failed (at once if it has), on the
        engine thread: e.g. to stop a server, so that a supervisor restarts it."""
        with self._closing:
            if self.dead is None:
                self._death_callbacks.append(callback)
                return
        callback(self.dead)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"the engine loop failed: {self.dead!r}")

    async def start_profile(self, out_dir: str | os.PathLike) -> None:
        """Start a ``torch.profiler`` trace of the engine loop (see ``EngineProfiler``)."""
        await self._call("profile", "start", out_dir)

    async def stop_profile(self) -> str:
        """Stop the trace; returns the path of the Chrome trace file written."""
        return str(await self._call("profile", "stop", None))

    async def _call(self, *cmd: object) -> object:
        """Run a command on the engine thread; its result, or its exception raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit((*cmd, done))
        return await asyncio.wrap_future(done)

    # Weights, cache and memory (docs/design.md §3.1): each runs on the engine thread once the
    # requests in flight have finished (on the old weights); requests submitted meanwhile
    # start after it. SGLang's names.
    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    async def update_weights_from_tensor(self, named_tensors) -> int:
        return await self._call("control", "update_weights_from_tensor", (named_tensors,))

    async def update_weights_from_disk(self, model_path: str | os.PathLike) -> int:
        return await self._call("control", "update_weights_from_disk", (model_path,))

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group",
                                        backend: str | None = None) -> None:
        await self._call("control", "init_weights_update_group",
                         (master_address, master_port, rank_offset, world_size, group_name,
                          backend))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]]) -> int:
        return await self._call("control", "update_weights_from_distributed",
                                (names, dtypes, shapes))

    async def flush_cache(self) -> None:
        await self._call("control", "flush_cache", ())

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("control", "release_memory_occupation", (tags,))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._call("control", "resume_memory_occupation", (tags,))

    async def pause_generation(self) -> int:
        """Stop generating at once: every request in flight ends with finish_reason "abort"
        (its tokens so far returned), and new requests wait for ``continue_generation``; a
        weight update meanwhile runs without waiting. Returns how many were aborted."""
        return await self._call("pause")

    async def continue_generation(self) -> None:
        """Start the requests that waited during the pause."""
        await self._call("continue")

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with a ``finish_reason="abort"`` output."""
        self._post(("abort", request_id))

    def _submit(self, cmd: tuple) -> None:
        """Hand the engine thread a command whose last element is a Future it will resolve."""
        if not self._post(cmd):
            raise RuntimeError("the engine is shut down")

    def _post(self, cmd: tuple) -> bool:
        """Queue ``cmd`` unless the engine thread has stopped reading (False then)."""
        with self._closing:
            if self._closed:
                return False
            self._inbox.put(cmd)
            return True

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=30)
        self.engine.shutdown()

    # Engine thread.
    def _handle(self, cmd: tuple) -> None:
        if cmd[0] == "add" and (self.paused or self._barriers):
            self._held.append(cmd)  # after the pause, or the weight update, ends
        elif cmd[0] == "add":
            _, rid, ids, tail, params, stream, accepted = cmd
            if not accepted.set_running_or_notify_cancel():
                return  # the caller left before the engine saw it: its abort follows
            try:
                self.engine.add_request(rid, ids, params, suffix_token_ids=tail)
            except Exception as e:  # a bad request is refused; nothing else is touched
                accepted.set_exception(e)
                return
            self._streams[rid] = stream
            accepted.set_result(None)
        elif cmd[0] == "profile":
            _, action, out_dir, done = cmd
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(self._profile(action, out_dir))
            except Exception as e:  # e.g. stop without start: the caller's error
                done.set_exception(e)
        elif cmd[0] == "abort":
            self._abort(cmd[1])
        elif cmd[0] == "control":
            self._barriers.append(cmd)
        elif cmd[0] in ("pause", "continue"):
            done = cmd[-1]
            if not done.set_running_or_notify_cancel():
                return
            self.paused = cmd[0] == "pause"
            if not self.paused:
                done.set_result(None)
                return
            in_flight = list(self.engine.requests)
            for rid in in_flight:
                self._abort(rid)
            done.set_result(len(in_flight))

    def _abort(self, request_id: str) -> None:
        for cmd in [c for c in self._held if c[0] == "add" and c[1] == request_id]:
            self._held.remove(cmd)  # its caller left while it waited
            if cmd[-1].set_running_or_notify_cancel():
                cmd[-1].set_exception(RuntimeError(f"request {request_id} was aborted"))
        out = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if out is not None and stream is not None:
            stream.put(out)

    def _run_barriers(self) -> None:
        """Run the waiting weight and memory operations once no request is in flight; then
        take in the requests held behind them."""
        while self._barriers and not self.engine.has_unfinished_requests():
            _, method, args, done = self._barriers.popleft()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(getattr(self.engine, method)(*args))
            except Exception as e:  # refused: the engine serves on as it was
                done.set_exception(e)
        while self._held and not self._barriers and not self.paused:
            self._handle(self._held.popleft())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None and not stream.put(out) and not out.finished:
                # Its caller's event loop is gone: nobody reads this stream again.
                self._streams.pop(out.request_id, None)
                self.engine.abort_request(out.request_id)

    def _profile(self, action: str, out_dir: str | os.PathLike | None) -> Path | None:
        if not self.engine.profilable:
            raise ValueError("profiling traces the single-process engine; the workers of a "
                             "multi-worker engine are not profiled")
        if action == "start":
            if self._profiler is None or (not self._profiler.active
                                          and self._profiler.out_dir != Path(out_dir)):
                self._profiler = EngineProfiler(out_dir)  # one per directory: names stay unique
            self._profiler.start()
            return None
        if self._profiler is None:
            raise ValueError("no profile is running: start one first")
        return self._profiler.stop()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
                    self._handle(cmd)
                    while True:
                        self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    if block:  # idle: a worker that dies now is noticed now
                        self.engine.watch()
                self._run_barriers()
                self._heap.maybe_trim()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    if self._profiler is not None and (path := self._profiler.step()):
                        logger.info("the profile reached %d iterations: trace written to %s",
                                    MAX_PROFILED_STEPS, path)
        except BaseException as e:  # report to every waiting caller rather than hang them
            logger.exception("the engine loop failed; no request can run now")
            self.dead = e
            for stream in self._streams.values():
                stream.put(EngineDead(f"the engine loop failed: {e!r}"))
            self._streams.clear()
        finally:  # shutdown or failure: every open stream ends with an "abort" output
            for rid in list(self.engine.requests):
                try:
                    out = self.engine.abort_request(rid)
                except Exception:  # a failed engine may fail here too: the stream still ends
                    logger.exception("aborting %s", rid)
                    out = None
                stream = self._streams.pop(rid, None)
                if stream is not None and out is not None:
                    stream.put(out)
            if self._profiler is not None and self._profiler.active:
                logger.info("profile trace written to %s", self._profiler.stop())
            with self._closing:
                self._closed = True
                callbacks, self._death_callbacks = self._death_callbacks, []
            while True:  # commands that came too late, or waited: refused
                try:
                    cmd = (self._barriers.popleft() if self._barriers else
                           self._held.popleft() if self._held else self._inbox.get_nowait())
                except queue.Empty:
                    break
                if isinstance(cmd[-1], concurrent.futures.Future) and \
                        cmd[-1].set_running_or_notify_cancel():
                    cmd[-1].set_exception(RuntimeError("the engine is shut down"))
            if self.dead is not None:
                for callback in callbacks:
                    callback(self.dead)
