"""Multi-worker serving: a front process (router, request table) and one worker process per
device, over ZeroMQ (control) and torch.distributed (K/V). See ``front.py``.

ZeroMQ is imported only when a multi-worker engine is built, so single-worker use (and the GPU
kernel checks, on machines without pyzmq) needs nothing beyond the model's own dependencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sangam.config import EngineConfig
from sangam.engine.engine import Engine
from sangam.engine.loaded_model import LoadedModel

if TYPE_CHECKING:
    from sangam.engine.multi.front import MultiWorkerEngine


def make_engine(config: EngineConfig,
                loaded: LoadedModel | None = None) -> Engine | MultiWorkerEngine:
    """The engine ``config`` asks for: in-process for one worker, else a front process with
    worker processes (the two share one interface)."""
    if config.is_multi_worker:
        from sangam.engine.multi.front import MultiWorkerEngine

        return MultiWorkerEngine(config, loaded)
    return Engine(config, loaded)


__all__ = ["make_engine"]
