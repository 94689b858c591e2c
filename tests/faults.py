"""Faults injected into the model's forward, for tests: a *poisoned* request (every forward
over its prompt raises, wherever it runs) and a *slow* one (the first forward over its prompt in
a process spins the CPU for a while, as a long prefill or K/V gather would). A request is
marked by a run of token ids in its prompt that a model never writes by chance.

``patched`` is the faulty forward (for monkeypatch), ``install`` patches this process, and
``worker_env`` gives the environment under which new Python processes (the workers' launcher)
patch themselves at startup, through ``sitecustomize``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

ENV = "SANGAM_TEST_FAULTS"
POISON = [96, 97, 98, 99]  # prompt tokens that mark a request (in every tiny vocabulary)
SLOW = [96, 98, 97, 99]


def _holds(ids: list[int], mark: list[int]) -> bool:
    n = len(mark)
    return any(ids[i:i + n] == mark for i in range(len(ids) - n + 1))


def patched(inner: Callable, poison: bool = False,
            spin_seconds: float | None = None) -> Callable:
    """``DiffusionLM.hidden_states`` (``inner``) with the faults."""
    spun: set[int] = set()  # processes that spun already (once each)

    def hidden_states(self, input_ids, *args, **kwargs):
        ids = input_ids.tolist()
        if poison and _holds(ids, POISON):
            raise RuntimeError("a poisoned request (test fault)")
        if spin_seconds and os.getpid() not in spun and _holds(ids, SLOW):
            spun.add(os.getpid())
            end = time.monotonic() + spin_seconds
            while time.monotonic() < end:  # busy: the loop's thread keeps computing
                pass
        return inner(self, input_ids, *args, **kwargs)

    return hidden_states


def install(**faults) -> None:
    from sangam.models.transformer import DiffusionLM

    DiffusionLM.hidden_states = patched(DiffusionLM.hidden_states, **faults)


_SITECUSTOMIZE = f"""
import json, os
if os.environ.get({ENV!r}):
    import faults
    faults.install(**json.loads(os.environ[{ENV!r}]))
"""


def worker_env(tmp_path: Path, **faults) -> dict[str, str]:
    """Environment variables under which new Python processes ``install(**faults)``."""
    site = tmp_path / "faults_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(site), str(tests), os.environ.get("PYTHONPATH", "")])
    return {ENV: json.dumps(faults), "PYTHONPATH": path}
