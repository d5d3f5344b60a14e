"""The package's import graph: no cycles, and no arrow that goes up the layer order.

Layers, top to bottom (docs/ARCHITECTURE.md):

    entrypoints, bench  ->  engine  ->  core, worker, distributed  ->  model, sample, structured  ->  attention
    ->  kernels

A module may import its own package, any package below it, and packages beside it in the same layer as
long as no cycle forms. The shared vocabulary (``config``, ``errors``, ``request``, ``sampling_params``,
``pooling_params``, ``outputs``, ``utils``) may be imported from anywhere and imports only itself.
Every import counts, including those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

LAYERS: list[set[str]] = [
    {"__init__", "__main__", "entrypoints", "bench"},
    {"engine"},
    {"core", "worker", "distributed"},
    {"model", "sample", "spec", "structured"},
    {"attention"},
    {"kernels"},
]
SHARED = {"config", "errors", "request", "sampling_params", "pooling_params", "outputs", "utils"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ``pagedllm`` module ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    own = _module_name(path).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names]
            found.update(n for n in [module, *names] if n.startswith("pagedllm"))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("pagedllm"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # ``from pagedllm.x import y`` names either module ``pagedllm.x.y`` or an attribute of x.
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _level(room: str) -> int:
    for i, layer in enumerate(LAYERS):
        if room in layer:
            return i
    raise AssertionError(f"package {room!r} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _module_room(module: str) -> str:
    room = _room(module)
    return "shared" if room in SHARED else room


def test_every_package_has_a_layer() -> None:
    for module in _graph():
        room = _module_room(module)
        if room != "shared":
            _level(room)


def test_no_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_goes_up_the_layers() -> None:
    wrong = []
    for module, targets in _graph().items():
        room = _module_room(module)
        for target in targets:
            target_room = _module_room(target)
            if target_room == "shared":
                continue
            if room == "shared" or _level(target_room) < _level(room):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_layer_checker_sees_upward_and_cyclic_imports() -> None:
    """The checks above would fail on a graph with an upward arrow or a cycle."""
    graph = {"pagedllm.kernels.a": {"pagedllm.engine.b"}, "pagedllm.engine.b": {"pagedllm.kernels.a"}}
    assert _cycles(graph) == [["pagedllm.engine.b", "pagedllm.kernels.a"]]
    assert _level("kernels") > _level("engine")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 600, f"{path.relative_to(PACKAGE)} has {lines} lines (at most 600)"
