"""Giving the C heap's free memory back to the system, now and then.

A long-running server churns through request bodies, JSON, token lists and small arrays; glibc's
malloc keeps the freed chunks in its arenas, fragmented, so resident memory creeps up although
the live data does not (measured: Python's traced allocations flat within 1 MB over minutes
while RSS rose about 10 MB a minute, and one ``malloc_trim`` gave back 40-73 MB; docs/
results.md). ``HeapTrimmer`` calls ``malloc_trim(0)`` at most every ``interval`` seconds,
which returns the arenas' free pages; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 30.0  # a trim costs milliseconds; memory may creep for this long between


def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only
    except OSError:
        return None


class HeapTrimmer:
    def __init__(self, interval: float = TRIM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._trim = _malloc_trim()
        self._next = clock() + interval
        self.trims = 0

    def maybe_trim(self) -> None:
        """Trim if ``interval`` seconds passed since the last (the engine loop calls this every
        turn: one clock read otherwise)."""
        if self._trim is None or self.clock() < self._next:
            return
        self._trim(0)
        self.trims += 1
        self._next = self.clock() + self.interval
