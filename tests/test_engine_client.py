"""Every engine offers its callers the same interface (sangam/engine/interface.py), and no
caller in the package asks which engine it has."""

from __future__ import annotations

import ast
from pathlib import Path

from sangam.config import EngineConfig
from sangam.engine.async_engine import AsyncEngine
from sangam.engine.engine import Engine
from sangam.engine.interface import EngineClient, SteppedEngine

PACKAGE = Path(__file__).resolve().parents[1] / "sangam"
ENGINE_CLASSES = {"Engine", "MultiWorkerEngine", "Front"}


def test_the_in_process_engine_and_async_engine_are_clients(llada_path):
    engine = Engine(EngineConfig(model=llada_path, device="cpu", page_size=4, num_pages=32))
    assert isinstance(engine, SteppedEngine) and isinstance(engine, EngineClient)
    names = [name for name, _, _ in engine.gauges()]
    assert "sangam_requests_in_flight" in names and "sangam_kv_pool_pages" in names
    assert engine.describe().startswith("LLaDAModelLM")
    wrapped = AsyncEngine(EngineConfig(model=llada_path, device="cpu", page_size=4,
                                       num_pages=32))
    try:
        assert isinstance(wrapped, EngineClient) and not isinstance(wrapped, SteppedEngine)
        assert [n for n, _, _ in wrapped.gauges()] == names
        assert wrapped.stats is wrapped.engine.stats and wrapped.profilable
    finally:
        wrapped.shutdown()


def test_no_caller_branches_on_the_engine_class():
    """``isinstance(x, Engine)`` (or the multi-worker front) anywhere in the package would be a
    caller that depends on which engine it has: they all offer ``EngineClient``."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "isinstance" and len(node.args) == 2):
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) \
                    else [node.args[1]]
                if any(isinstance(k, ast.Name) and k.id in ENGINE_CLASSES for k in kinds):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, found
