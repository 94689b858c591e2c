"""The control plane's message set between a front and its workers: small dataclasses, handed
over directly to an in-process worker, pickled over ZeroMQ to worker processes.

Pickle is acceptable here because every peer is a process of this deployment on a trusted
network (loopback on one host, the cluster's network across nodes), as with torch.distributed's
own store. K/V tensors never travel here: they go over torch.distributed (``kv_transfer``).

Every message about a request carries its ``attempt``, a number the front draws afresh (never
reused, even for a reused request id) whenever it takes the request back (worker failure,
failed transfer); it drops events of other attempts, so a late report about abandoned work can
never be mistaken for progress.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import numpy as np

from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.sched.worker_core import IterationStats


@dataclass
class BlockProgress:
    """What the forwards of one block changed in a request's state: that block's positions
    and the counters. A front and its worker processes exchange this instead of the whole
    state, whose prompt, suffix and other blocks the receiving side already has."""

    start: int  # the block's first position
    tokens: np.ndarray
    confidence: np.ndarray
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    block: int
    step: int
    num_forwards: int
    finish_reason: str | None  # None: not finished
    stop_len: int | None
    stop_string: str | None
    stop_text: IncrementalDetokenizer | None
    force_refresh: bool  # the next block refreshes fully (the adaptive trigger fired)
    threshold: float  # the threshold the block used (load-adaptive)


def block_progress(state: DecodeState, block: int) -> BlockProgress:
    """What the forwards of ``block`` changed in ``state`` (positions are only ever committed
    in the current block, so its positions and the counters are all of it)."""
    b = state.params.block_length
    s = state.block_origin + block * b
    e = s + b
    top = slice(max(0, s - state.prompt_len), e - state.prompt_len)
    return BlockProgress(
        s, state.tokens[s:e].copy(), state.confidence[s:e].copy(),
        None if state.top_ids is None else state.top_ids[top].copy(),
        None if state.top_logprobs is None else state.top_logprobs[top].copy(),
        state.block, state.step, state.num_forwards, state.finish_reason, state.stop_len,
        state.stop_string, state.stop_text, state.force_refresh,
        float(state.block_thresholds[block]))


def catch_up(state: DecodeState, p: BlockProgress) -> None:
    """Take ``p`` (another process's ``block_progress`` of this request) into ``state``."""
    e = p.start + len(p.tokens)
    state.tokens[p.start:e] = p.tokens
    state.confidence[p.start:e] = p.confidence
    if p.top_ids is not None:
        top = slice(max(0, p.start - state.prompt_len), e - state.prompt_len)
        state.top_ids[top] = p.top_ids
        state.top_logprobs[top] = p.top_logprobs
    state.cursor.catch_up(p.block, p.step, p.force_refresh)
    state.num_forwards = p.num_forwards
    state.finish(p.finish_reason)
    state.stop_len, state.stop_string, state.stop_text = p.stop_len, p.stop_string, p.stop_text
    state.block_thresholds[(p.start - state.block_origin) // state.params.block_length] = \
        p.threshold

# Front -> worker.


@dataclass
class Prefill:
    """Run the next block's refresh of a request (its state is at a block start; None: the
    state this worker kept with the canvas at the end of the request's last block here).

    ``kv_dest`` is None: this worker runs the whole block, refresh and cached steps. At the
    block's end it keeps the canvas pages and the state (``keep_pages``: it is the request's
    canvas holder) or frees them; with ``stays`` it runs every later block too. ``kv_dest`` is
    a worker: run the refresh only, send the K/V there, free.
    """

    request_id: str
    attempt: int
    state: DecodeState | None
    arrival: float
    seq: int  # the request's place among equal arrivals (Request.seq)
    kv_dest: int | None
    keep_pages: bool
    stays: bool


@dataclass
class ReceiveKV:
    """Receive a request's K/V from ``src`` (transfer ``transfer_id``), then seat it for its
    cached steps with ``state`` (at the block's start; None: the one this worker kept with the
    canvas) advanced by the refresh's ``progress``. With ``drain`` the K/V is received into
    scratch memory and discarded: the sender must not hang."""

    request_id: str
    attempt: int
    src: int
    transfer_id: int
    num_pages: int
    state: DecodeState | None
    progress: BlockProgress | None
    arrival: float
    seq: int
    drain: bool


@dataclass
class Drop:
    """Forget a request entirely and free whatever it holds here (finished elsewhere, aborted,
    or taken back after a failure). A K/V receive in progress is drained."""

    request_id: str


@dataclass
class PeerDead:
    """``worker`` died: abandon transfers with it (never start one again)."""

    worker: int


@dataclass
class Shutdown:
    pass


@dataclass
class Kill:
    """Sent to a worker's heartbeat thread, not its loop: the front declared the worker dead,
    so the process must exit now even if its loop is stuck (a worker on another node has no
    local parent to kill it)."""


# Worker -> front.


@dataclass
class Hello:
    """A worker is up: model loaded, pool allocated, process group joined."""

    worker: int
    pid: int
    host: str
    device: str
    num_pages: int
    layer_page_bytes: int  # one page of one layer's K (or V): a transfer moves L * 2 per page
    signature: tuple  # the deployment as this worker understands it; must match the front's


@dataclass
class Heartbeat:
    """From a worker's heartbeat thread, which runs even while its loop is busy or stuck."""

    worker: int
    loop_cpu_s: float | None  # CPU seconds its loop's thread has used (None: unknown here)


@dataclass
class WorkerFailed:
    """The worker loop raised; the process exits right after sending this."""

    worker: int
    error: str


@dataclass
class RefreshRan:
    """A refresh forward ended (its prefill tokens leave the router's load), or a chunk of
    one (``chunk``: the rest waits)."""

    request_id: str
    attempt: int
    seconds: float  # the forward's duration
    chunk: bool = False
    cached_tokens: int = 0  # prompt tokens its prefill found in the prefix cache


@dataclass
class KVSent:
    """The refresh's K/V went out to ``dest`` (all layers' sends are posted). With ``drain``
    (the refresh itself completed the block, and the next starts with a full refresh: nothing
    to decode there) the receiver discards."""

    request_id: str
    attempt: int
    dest: int
    transfer_id: int
    num_pages: int
    nbytes: int
    streamed_layers: int  # layers whose send was posted while the forward still ran
    progress: BlockProgress  # the refresh's commits (the receiver has the rest of the state)
    drain: bool
    # False: the K/V could not be gathered (out of memory) or the pair failed; what was
    # posted is filler, for the receiver to discard, and the block is placed again.
    ok: bool


@dataclass
class KVReceived:
    """A receive finished: ``ok`` -> scattered into ``pages`` and seated; otherwise drained
    (no pages, dropped meanwhile, or the sender failed)."""

    request_id: str
    attempt: int
    src: int
    transfer_id: int
    ok: bool
    nbytes: int
    pages: list[int]
    budget_wait: bool  # it waited for transfer buffer budget before its receives were posted


@dataclass
class BlockDone:
    """A block completed (or the request finished) here: its ``progress`` (None from an
    in-process worker, whose state is the front's); ``pages`` are the canvas pages this worker
    keeps for the request, with its state (empty when it freed them). With ``continues`` the
    next block runs on without being placed again: here (the request stays, or starts it from
    cached K/V), or on the receiver of this refresh's K/V (no pages are parked)."""

    request_id: str
    attempt: int
    progress: BlockProgress | None
    pages: list[int]
    continues: bool = False


@dataclass
class RequestFailed:
    """A request's step failed here (the others of its batch went on): it is dropped here, and
    the front ends it with ``error``."""

    request_id: str
    attempt: int
    error: str


Event = RefreshRan | KVSent | KVReceived | BlockDone | RequestFailed


@dataclass
class Report:
    """What happened on a worker since its last report, in order; also sent when only its
    free pages or open transfers changed, so the front's view of them settles, and at least
    every second while it has work (the front's watchdog)."""

    worker: int
    events: list[Event] = field(default_factory=list)
    iterations: list[IterationStats] = field(default_factory=list)
    free_pages: int = 0
    open_transfers: int = 0  # K/V sends and receives not yet complete
    handled: int = 0  # control messages handled so far (the front's watchdog counts them)
    busy: bool = False  # it has work: requests to run or wait for, or open transfers


def dumps(msg: object) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> object:
    return pickle.loads(data)
