"""Multi-worker serving: a front process (router, request table) and one worker process per
device, over ZeroMQ (control) and torch.distributed (K/V). See ``front.py``.

ZeroMQ is imported only when a multi-worker engine is built, so single-worker use (and the GPU
kernel checks, on machines without pyzmq) needs nothing beyond the model's own dependencies.
"""

from __future__ import annotations

from sangam.config import EngineConfig
from sangam.engine.engine import Engine
from sangam.engine.interface import SteppedEngine
from sangam.engine.loaded_model import LoadedModel


def make_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> SteppedEngine:
    """The engine ``config`` asks for: in-process for one worker, else a front over worker
    processes (both a ``SteppedEngine``)."""
    if config.is_multi_worker:
        from sangam.engine.multi.front import MultiWorkerEngine

        return MultiWorkerEngine(config, loaded)
    return Engine(config, loaded)


__all__ = ["make_engine"]
