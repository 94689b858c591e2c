"""The control plane between a front and its worker processes: the policy core's orders and
reports about requests (``sched/messages.py``, re-exported here), the processes' own messages
(hellos, heartbeats, failures, shutdown, the reports' envelope), and a block's progress
(``BlockProgress``: what a block's forwards changed in a request's ``DecodeState``, the payload
its reports carry between processes). Small dataclasses, handed over directly to an in-process
worker, pickled over ZeroMQ to worker processes.

Pickle is acceptable here because every peer is a process of this deployment on a trusted
network (loopback on one host, the cluster's network across nodes), as with torch.distributed's
own store. K/V tensors never travel here: they go over torch.distributed (``kv_transfer``).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

import numpy as np

from sangam.decoding.detokenizer import IncrementalDetokenizer
from sangam.decoding.state import DecodeState
from sangam.decoding.uniform import Canvas
from sangam.sched.messages import (
    BlockDone,
    Draft,
    Drop,
    Event,
    KVReceived,
    KVSent,
    PeerDead,
    Prefill,
    ReceiveKV,
    RefreshRan,
    RequestFailed,
)
from sangam.sched.worker_core import IterationStats

__all__ = [  # with the policy core's messages, as engine code names them (msg.Prefill, ...)
    "BlockDone", "BlockProgress", "Control", "ControlDone", "Draft", "Drop", "Event", "Heartbeat",
    "Hello", "KVReceived", "KVSent", "Kill", "PeerDead", "Prefill", "ReceiveKV", "RefreshRan",
    "Report", "RequestFailed", "Shutdown", "WorkerFailed", "block_progress", "catch_up", "dumps",
    "loads",
]


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
    canvas: Canvas | None = None  # a uniform-state request's canvas in progress
    trajectory: list | None = None  # return_trajectory: what the block's forwards wrote


def block_progress(state: DecodeState, block: int) -> BlockProgress:
    """What the forwards of ``block`` changed in ``state`` (positions are only ever committed
    in the current block, so its positions and the counters are all of it)."""
    c = state.cursor
    s, e = c.block_bounds(block)
    top = slice(max(0, s - c.prompt_len), e - c.prompt_len)
    return BlockProgress(
        s, state.tokens[s:e].copy(), state.confidence[s:e].copy(),
        None if state.top_ids is None else state.top_ids[top].copy(),
        None if state.top_logprobs is None else state.top_logprobs[top].copy(),
        c.block, c.step, state.num_forwards, state.finish_reason, state.stop_len,
        state.stop_string, state.stop_text, c.force_refresh,
        float(state.block_thresholds[block]), state.canvas,
        None if state.trajectory is None else [t for t in state.trajectory if s <= t[0] < e])


def catch_up(state: DecodeState, p: BlockProgress) -> None:
    """Take ``p`` (another process's ``block_progress`` of this request) into ``state``."""
    c = state.cursor
    e = p.start + len(p.tokens)
    state.tokens[p.start:e] = p.tokens
    state.confidence[p.start:e] = p.confidence
    if p.top_ids is not None:
        top = slice(max(0, p.start - c.prompt_len), e - c.prompt_len)
        state.top_ids[top] = p.top_ids
        state.top_logprobs[top] = p.top_logprobs
    c.catch_up(p.block, p.step, p.force_refresh)
    state.num_forwards = p.num_forwards
    state.finish(p.finish_reason)
    state.stop_len, state.stop_string, state.stop_text = p.stop_len, p.stop_string, p.stop_text
    state.block_thresholds[c.block_of(p.start)] = p.threshold
    state.canvas = p.canvas
    if p.trajectory is not None:  # the block's entries, as the other process wrote them
        state.trajectory = [t for t in state.trajectory if not p.start <= t[0] < e] + \
            p.trajectory

# Front -> worker.


@dataclass
class Shutdown:
    pass


@dataclass
class Control:
    """An operation for every rank of a worker, run between iterations with no request in
    flight (``engine/worker_control.py``: ``op`` names a ``WorkerControl`` method, ``args`` its
    arguments); answered by a ``ControlDone`` with the same ``ticket``."""

    ticket: int
    op: str
    args: tuple = ()


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
    # One page of one layer's K (or V), averaged over layers whose shapes differ: a transfer
    # moves L * 2 per page.
    layer_page_bytes: int
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
class ControlDone:
    """A worker ran the front's ``Control`` (``error``: why it did not, the model unchanged)."""

    ticket: int
    error: str | None = None


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
