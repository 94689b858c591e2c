"""The layers of docs/design.md §1, as the imports say: serve / bench -> engine -> (sched, models,
decoding) -> kernels, each depending only on the ones below (never sideways between the three
of the middle); every module of the package, top-level ones too, is in a unit of ALLOWED; no
two modules import each other, however indirectly; and the policy core imports without
PyTorch."""

from __future__ import annotations

import ast
import importlib.machinery
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sangam"
ROOT = PACKAGE.name
# A unit is a subpackage of sangam or a top-level module (``sangam``: the package's own
# __init__). A module may import its own unit's modules and those of the units listed.
ALLOWED = {
    # Below every layer.
    "sampling_params": set(),
    "config": {"sampling_params", "sched"},  # the engine's options check the policies' names
    "demo": set(),  # the bundled demo model's files
    "_host": set(),  # the C++ host path (csrc/), a compiled extension
    # The layers.
    "kernels": set(),
    "decoding": {"kernels", "sampling_params", "sched"},  # a request's BlockCursor
    "models": {"kernels"},
    "sched": {"sampling_params"},
    "engine": {"sched", "models", "decoding", "kernels", "config", "sampling_params", "demo",
               "_host"},
    # Above the engine.
    "llm": {"engine", "models", "config", "sampling_params"},
    "sangam": {"llm", "config", "sampling_params"},
    "serve": {"engine", "sched", "models", "decoding", "kernels", "config", "sampling_params",
              "sangam"},
    "testing": {"models"},  # tiny checkpoints and real shapes, for tests and benchmarks
    "bench": {"engine", "serve", "sched", "models", "decoding", "kernels", "config",
              "sampling_params", "demo", "testing", "sangam"},
    "client": set(),
    "cli": {"serve", "bench", "client"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether ``sangam.a.b`` names a module (source, package or compiled extension), not an
    attribute of one."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()
            or any(path.with_name(path.name + suffix).is_file()
                   for suffix in importlib.machinery.EXTENSION_SUFFIXES))


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations only, never
    run."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            hidden.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return hidden


def _imports(path: Path) -> set[str]:
    """Every module of the package that ``path`` imports, at any depth (function-level imports
    too; not those under ``if TYPE_CHECKING:``). ``from sangam.a import b`` imports the module
    ``sangam.a.b`` when there is one, else ``sangam.a``."""
    tree = ast.parse(path.read_text())
    hidden = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.ImportFrom):
            # The package imports by absolute names only, which this graph reads.
            assert not node.level, f"{path}:{node.lineno}: a relative import"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _is_module(sub) else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == ROOT}


def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself excluded)."""
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        graph[name] = _imports(path) - {name}
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def test_every_module_imports_its_own_unit_and_the_allowed_ones_only():
    wrong = []
    for module, imported in _graph().items():
        here = _unit(module)
        if here not in ALLOWED:
            wrong.append(f"{module}: its unit {here!r} is not in ALLOWED")
            continue
        for other in sorted(imported):
            there = _unit(other)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{module} ({here}) imports {other} ({there})")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's
    algorithm, then a shortest path back to a component's first module), as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier:  # breadth-first within the component, back to ``start``
            v = frontier.pop(0)
            nxt = sorted(graph[v] & component)
            if start in nxt:
                cycles.append(paths[v] + [start])
                break
            for w in nxt:
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    frontier.append(w)
    return cycles


def test_the_cycle_finder_prints_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"{numpy}):
            raise ImportError(f"{{what}} imported {{name}}")
sys.meta_path.insert(0, NoTorch())
import pkgutil, importlib
{imports}
print("ok")
"""


def _imports_without(what: str, imports: str, numpy: bool) -> None:
    code = _NO_TORCH.format(numpy=', "numpy"' if not numpy else "", what=what, imports=imports)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PACKAGE.parent)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_the_policy_core_imports_without_torch():
    """The policy core: neither PyTorch nor numpy."""
    _imports_without("the policy core", """import sangam.sched
for m in pkgutil.iter_modules(sangam.sched.__path__):
    importlib.import_module("sangam.sched." + m.name)
from sangam import SamplingParams, EngineConfig""", numpy=False)


def test_the_simulator_and_the_model_shapes_import_without_torch():
    """The simulator (and the model shapes, checkpoint rules and sharding it reads): numpy, but
    no PyTorch, so that studying a deployment needs no deep-learning stack."""
    _imports_without("the simulator", """import sangam.bench.sim
from sangam.bench.sim.simulator import Simulator
from sangam.models import ModelConfig, ShardLayout, parse_config
import sangam.models.registry""", numpy=True)


def test_every_name_the_models_package_exports_resolves():
    """``sangam.models`` imports its names when first used: each one it lists is there."""
    import sangam.models

    for name in sangam.models.__all__:
        assert getattr(sangam.models, name) is not None, name
