"""``torch.profiler`` traces of the engine loop, started and stopped on request, as vLLM's
``/start_profile`` and ``/stop_profile``: every forward, kernel launch and host phase between
the two calls, written as a Chrome trace (open it in Perfetto or ``chrome://tracing``).

Call both from the engine's own thread (``AsyncEngine`` does): the profiler records the
thread that started it.

Traces are bounded, since each is a file on the server's disk: a profile records at most
``MAX_PROFILED_STEPS`` engine iterations (then writes its trace by itself; the next stop
returns that file), and a directory keeps this profiler's newest ``MAX_TRACES`` traces only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

MAX_PROFILED_STEPS = 200  # a trace of this many iterations of an 8B model is ~100 MB
MAX_TRACES = 8


class EngineProfiler:
    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self._profile: torch.profiler.profile | None = None
        self._count = 0  # traces written: a part of each file's name, so none is overwritten
        self._steps = 0  # iterations recorded by the running profile
        self._written: list[Path] = []  # this profiler's traces, oldest first
        self._unclaimed: Path | None = None  # written at the step cap, before any stop

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            raise ValueError("a profile is already running: stop it first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._steps = 0
        self._unclaimed = None

    def step(self) -> Path | None:
        """Count one engine iteration; at the cap, end the profile and return its trace."""
        if self._profile is None:
            return None
        self._steps += 1
        if self._steps < MAX_PROFILED_STEPS:
            return None
        self._unclaimed = self._write()
        return self._unclaimed

    def stop(self) -> Path:
        """End the profile; returns the trace file written (by the step cap, if it was)."""
        if self._unclaimed is not None:
            path, self._unclaimed = self._unclaimed, None
            return path
        if self._profile is None:
            raise ValueError("no profile is running: start one first")
        return self._write()

    def _write(self) -> Path:
        profile, self._profile = self._profile, None
        profile.stop()
        self._count += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.out_dir / f"sangam-trace-{stamp}-{os.getpid()}-{self._count}.json"
        profile.export_chrome_trace(str(path))
        self._written.append(path)
        while len(self._written) > MAX_TRACES:
            self._written.pop(0).unlink(missing_ok=True)
        return path
