"""What a front and its workers tell each other about requests (docs/design.md §4.6): the
front's orders (run a block, receive K/V, forget a request, a peer died) and the workers'
reports (a refresh ran, K/V went out or landed, a block ended, a request failed).

Plain dataclasses, the same wherever they travel: handed over as objects to an in-process
worker, pickled over ZeroMQ to worker processes (``engine/messages.py`` adds the processes'
own messages: hellos, heartbeats, the reports' envelope), applied to simulated workers by the
simulator. A request's state and a block's progress ride as opaque payloads (the engine's
``DecodeState`` and ``BlockProgress``, the simulator's draws): the front core never reads
them.

Every message about a request carries its ``attempt``, a number the front draws afresh
(never reused, even for a reused request id) whenever it takes the request back (worker
failure, failed transfer); reports of another attempt are dropped, so a late report about
abandoned work can never be mistaken for progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Front -> worker.


@dataclass
class Prefill:
    """Run the next block's refresh of a request: its ``state`` is at a block start (None: the
    state this worker parked with the canvas at the end of the request's last block here).

    ``kv_dest`` is None: this worker runs the whole block, refresh and cached steps. At the
    block's end it keeps the canvas pages and the state (``keep_pages``: it is the request's
    canvas holder) or frees them; with ``stays`` it runs every later block too. ``kv_dest`` is
    a worker: run the refresh only, send the K/V there, free.
    """

    request_id: str
    attempt: int
    state: Any
    arrival: float
    seq: int  # the request's place among equal arrivals (Request.seq)
    kv_dest: int | None
    keep_pages: bool
    stays: bool


@dataclass
class ReceiveKV:
    """Receive a request's K/V from ``src`` (transfer ``transfer_id``), then seat it for its
    cached steps with ``state`` (at the block's start; None: the one this worker parked with
    the canvas) advanced by the refresh's ``progress``. With ``drain`` the K/V is received into
    scratch memory and discarded: the sender must not hang."""

    request_id: str
    attempt: int
    src: int
    transfer_id: int
    num_pages: int
    state: Any
    progress: Any
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


# Worker -> front.


@dataclass
class RefreshRan:
    """A refresh forward ended (its prefill tokens leave the router's load), or a chunk of
    one (``chunk``: the rest waits)."""

    request_id: str
    attempt: int
    seconds: float  # the forward's duration: it began ``seconds`` before the report
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
    progress: Any  # the refresh's commits (the receiver has the rest of the state)
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
    """A block completed here: the request's cursor is now at (``block``, ``step``,
    ``force_refresh``) after ``forwards`` forwards, or it ``finished``. ``pages`` are the canvas
    pages this worker keeps for the request, with its state (empty when it freed them). With
    ``continues`` the next block runs on without being placed again: here (the request stays,
    or starts it from cached K/V), or on the receiver of this refresh's K/V (no pages are
    parked). ``progress``: the block's commits, for a front in another process (None in
    process, where the front's state is the worker's)."""

    request_id: str
    attempt: int
    block: int
    step: int
    force_refresh: bool
    forwards: int
    finished: bool
    pages: list[int]
    continues: bool = False
    progress: Any = None


@dataclass
class Draft:
    """A step of a request that asked for drafts (``SamplingParams.include_drafts``) ran
    without ending its block: ``tokens`` is the block's provisional content now (from the
    response's start of the block): a uniform-state canvas's argmax, or a masked block's
    committed tokens with each masked position's token as this step predicted it."""

    request_id: str
    attempt: int
    block: int
    tokens: list[int]


@dataclass
class RequestFailed:
    """A request's step failed here (the others of its batch went on): it is dropped here, and
    the front ends it with ``error``."""

    request_id: str
    attempt: int
    error: str


Order = Prefill | ReceiveKV | Drop | PeerDead
Event = RefreshRan | KVSent | KVReceived | BlockDone | Draft | RequestFailed
