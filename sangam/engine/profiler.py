"""``torch.profiler`` traces of the engine loop, started and stopped on request, as vLLM's
``/start_profile`` and ``/stop_profile``: every forward, kernel launch and host phase between
the two calls, written as a Chrome trace (open it in Perfetto or ``chrome://tracing``).

Call both from the engine's own thread (``AsyncEngine`` does): the profiler records the
thread that started it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


class EngineProfiler:
    def __init__(self, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self._profile: torch.profiler.profile | None = None
        self._count = 0  # traces written: a part of each file's name, so none is overwritten

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

    def stop(self) -> Path:
        """End the profile; returns the trace file written."""
        if self._profile is None:
            raise ValueError("no profile is running: start one first")
        profile, self._profile = self._profile, None
        profile.stop()
        self._count += 1
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = self.out_dir / f"sangam-trace-{stamp}-{os.getpid()}-{self._count}.json"
        profile.export_chrome_trace(str(path))
        return path
