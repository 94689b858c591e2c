"""The layers of DESIGN.md §1, as the imports say: serve / bench -> engine -> (sched, models,
decoding) -> kernels, each depending only on the ones below (never sideways between the three
of the middle, except decoding's rules under models' none), and the policy core imports without
PyTorch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sangam"
# A module of a layer may import those of the layers listed (and its own, and what is shared
# below every layer: config, sampling_params, the demo model's files).
ALLOWED = {
    "kernels": set(),
    "decoding": {"kernels"},
    "models": {"kernels"},
    "sched": set(),
    "engine": {"sched", "models", "decoding", "kernels"},
    "serve": {"engine", "sched", "models", "decoding", "kernels"},
    "bench": {"engine", "serve", "sched", "models", "decoding", "kernels"},
}
LAYERS = set(ALLOWED)


def _imports(path: Path) -> set[str]:
    """Every ``sangam.X`` module ``path`` imports, at any depth (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "sangam"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_depend_downwards_only():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        here = _layer("sangam." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if here not in ALLOWED:
            continue
        for module in _imports(path):
            there = _layer(module)
            if there is not None and there != here and there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} ({here}) imports {module}")
    assert not wrong, "\n".join(wrong)


_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "numpy"):
            raise ImportError(f"the policy core imported {name}")
sys.meta_path.insert(0, NoTorch())
import pkgutil, importlib, sangam.sched
for m in pkgutil.iter_modules(sangam.sched.__path__):
    importlib.import_module("sangam.sched." + m.name)
from sangam import SamplingParams, EngineConfig
print("ok")
"""


def test_the_policy_core_imports_without_torch():
    run = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True,
                         cwd=PACKAGE.parent)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
