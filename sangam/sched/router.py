"""Router: which worker runs each prefill, and which holds each canvas (docs/design.md §4, Modes).

Pure Python, no tensors: the engine and the simulator drive the same object, through
``Placement``, over its records of requests (``Placed``). It decides; Placement commits.

Load is the number of *outstanding prefill tokens* per worker: ``route_prefill`` records
``req.cursor.span_len`` on the worker it picks (through ``add``), and the driver calls
``done(worker, tokens)`` when that refresh's forward ends, or when the request is aborted
before it. A request *holds its canvas* on ``req.holder`` (Placement's).
A worker *has room* for a prefill when its free pages cover the pages the request would need
there: none on the worker that holds its canvas, ``req.pages_needed`` elsewhere (a new
canvas, or a prefill worker's transient pages for the refresh).

Policy (dead workers are never chosen; "least loaded" ties are broken by a seeded
``random.Random``, so a run is reproducible from ``seed`` and the sequence of calls):
- colocated: a request that holds its canvas re-prefills where it is (the pages stay). A new
  request goes to the least-loaded worker among those with room, or among all live workers
  when none has room (it then waits there for memory).
- disaggregated: every prefill, new or re-prefill, goes to the least-loaded prefill worker,
  preferring those with room, as above. The K/V then goes to the canvas's decode worker.
- hybrid: as disaggregated, except when *every* live prefill worker has at least ``theta``
  outstanding tokens: then the prefill overflows to a decode worker below ``theta`` that has
  room, the least loaded. A request that holds its canvas on a decode worker overflows only to
  that worker (no K/V to move, no pages to find); if no decode worker qualifies, the prefill
  stays with the prefill workers.
- ``route_decode`` (where a canvas lives): a request that holds its canvas stays (in-flight
  decodes are never migrated); otherwise the live decode-capable worker (role "decode", or any
  worker when colocated) with the most free pages that fit it, ties broken at random; None if
  none fits now.
- Failover (disaggregated, hybrid): while workers of only one role survive (``one_role_left``),
  they serve as colocated workers do: prefill workers hold canvases and decode, or decode
  workers run refreshes, each block on the worker that holds its canvas.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from sangam.sched.config import MODES, ROLES, DeploymentConfig

if TYPE_CHECKING:
    from sangam.sched.placement import Placed


class Router:
    """Invariants: ``load[w] >= 0`` for every worker; a dead worker stays dead until a new
    process takes its place (``revive``)."""

    def __init__(self, mode: str, roles: list[str], overflow_threshold: int | None = None,
                 seed: int = 0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not roles or any(r not in ROLES for r in roles):
            raise ValueError(f"roles must be a non-empty list over {ROLES}, got {roles!r}")
        if mode == "colocated":
            if set(roles) != {"colocated"}:
                raise ValueError(f"colocated mode needs every role 'colocated', got {roles!r}")
        elif set(roles) != {"prefill", "decode"}:
            raise ValueError(f"{mode} mode needs 'prefill' and 'decode' workers only, at least "
                             f"one of each, got {roles!r}")
        if mode == "hybrid" and (overflow_threshold is None or overflow_threshold < 0):
            raise ValueError("hybrid mode needs overflow_threshold >= 0 (theta, in tokens)")
        self.mode = mode
        self.roles = list(roles)
        self.overflow_threshold = overflow_threshold  # theta; used in hybrid mode only
        self._rng = random.Random(seed)
        self._load = [0] * len(roles)
        self._alive = [True] * len(roles)
        self._prefill_workers = [w for w, r in enumerate(roles) if r != "decode"]
        self._decode_workers = [w for w, r in enumerate(roles) if r != "prefill"]

    @classmethod
    def for_deployment(cls, deployment: DeploymentConfig) -> Router:
        return cls(deployment.mode, list(deployment.roles), deployment.overflow_threshold,
                   deployment.seed)

    @property
    def num_workers(self) -> int:
        return len(self.roles)

    def load(self, worker: int) -> int:
        """Outstanding prefill tokens on ``worker``."""
        return self._load[worker]

    def is_alive(self, worker: int) -> bool:
        return self._alive[worker]

    # Accounting.
    def add(self, worker: int, tokens: int) -> None:
        """A prefill of ``tokens`` was placed on ``worker`` (``route_prefill`` calls this)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self._load[worker] += tokens

    def done(self, worker: int, tokens: int) -> None:
        """A prefill of ``tokens`` on ``worker`` ended (its forward ran, or it was aborted)."""
        if not 0 <= tokens <= self._load[worker]:
            raise ValueError(f"worker {worker} has {self._load[worker]} outstanding prefill "
                             f"tokens, cannot release {tokens}")
        self._load[worker] -= tokens

    def mark_dead(self, worker: int) -> None:
        self._alive[worker] = False

    def revive(self, worker: int) -> None:
        """A new process took dead ``worker``'s place (it carries no load)."""
        self._alive[worker] = True
        self._load[worker] = 0

    @property
    def one_role_left(self) -> bool:
        """Disaggregated or hybrid, with no live prefill worker or no live decode worker: the
        live ones serve as colocated workers (see the module's docstring)."""
        return self.mode != "colocated" and not (self._live(self._prefill_workers)
                                                 and self._live(self._decode_workers))

    def prefill_capable(self) -> list[int]:
        """The live workers that may run a refresh now."""
        return self._live(self._prefill_workers) or self._live(self._decode_workers)

    def canvas_capable(self) -> list[int]:
        """The live workers that may hold a canvas (and decode) now."""
        return self._live(self._decode_workers) or self._live(self._prefill_workers)

    # Placement.
    def route_prefill(self, req: Placed, free_pages: list[int]) -> int:
        """The worker that runs ``req``'s next refresh; records its cost there as load."""
        self._check(free_pages)
        holder = req.holder
        if holder is not None and (self.mode == "colocated" or self.one_role_left):
            if not self._alive[holder]:
                raise RuntimeError(f"request {req.request_id!r}: worker {holder}, which holds "
                                   f"its pages, is dead")
            worker = holder
        else:
            worker = self._overflow(req, holder, free_pages)
            if worker is None:
                prefill = self.prefill_capable()
                if not prefill:
                    raise RuntimeError("no worker is alive")
                worker = self._least_loaded(self._with_room(req, holder, prefill, free_pages)
                                            or prefill)
        self.add(worker, req.cursor.span_len)
        return worker

    def route_decode(self, req: Placed, free_pages: list[int]) -> int | None:
        """The worker that holds ``req``'s canvas; None if no live one has room now."""
        self._check(free_pages)
        if req.holder is not None:  # never migrated
            if not self._alive[req.holder]:
                raise RuntimeError(f"request {req.request_id!r}: worker {req.holder}, which "
                                   f"holds its pages, is dead")
            return req.holder
        fit = [w for w in self.canvas_capable() if free_pages[w] >= req.pages_needed]
        if not fit:
            return None
        most = max(free_pages[w] for w in fit)
        return self._pick([w for w in fit if free_pages[w] == most])

    # Helpers.
    def _overflow(self, req: Placed, holder: int | None, free_pages: list[int]) -> int | None:
        """Hybrid: a decode worker for this prefill when every prefill worker is busy."""
        if self.mode != "hybrid" or self.one_role_left:
            return None
        theta = self.overflow_threshold
        if any(self._load[w] < theta for w in self._live(self._prefill_workers)):
            return None
        decode = [w for w in self._live(self._decode_workers) if self._load[w] < theta]
        if holder is not None:  # its canvas is on a decode worker: only there
            decode = [w for w in decode if w == holder]
        fit = self._with_room(req, holder, decode, free_pages)
        return self._least_loaded(fit) if fit else None

    def _with_room(self, req: Placed, holder: int | None, workers: list[int],
                   free_pages: list[int]) -> list[int]:
        return [w for w in workers if w == holder or free_pages[w] >= req.pages_needed]

    def _live(self, workers: list[int]) -> list[int]:
        return [w for w in workers if self._alive[w]]

    def _least_loaded(self, workers: list[int]) -> int:
        least = min(self._load[w] for w in workers)
        return self._pick([w for w in workers if self._load[w] == least])

    def _pick(self, tied: list[int]) -> int:
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _check(self, free_pages: list[int]) -> None:
        if len(free_pages) != len(self.roles):
            raise ValueError(f"free_pages has {len(free_pages)} entries for "
                             f"{len(self.roles)} workers")
