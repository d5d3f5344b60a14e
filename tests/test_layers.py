"""The package's import graph: no cycles, and no arrow that goes up the layer order.

Layers, top to bottom (docs/ARCHITECTURE.md):

    entrypoints  ->  engine  ->  sched, worker, distributed  ->  lora  ->  model, sample, structured
    ->  attention
    ->  kernels

A module may import its own package, any package below it, and packages beside it in the same layer as
long as no cycle forms. The shared vocabulary (``config``, ``errors``, ``request``, ``sampling_params``,
``pooling_params``, ``outputs``, ``utils``, ``lora_request``) may be imported from anywhere and imports only itself.
Every import counts, including those inside functions and under ``TYPE_CHECKING``. Between packages of
one layer, only the arrows listed in ``SAME_LAYER_ARROWS`` (the ones there are) may exist, and no
other pair both ways: a new one is a decision to write down there and in docs/ARCHITECTURE.md.

Inside ``engine`` the rooms point one way: the loop and its processors (``pagedllm.engine.*``) never
import the processes' transport (``engine.proc``), and ``engine.observe`` imports nothing else of the
engine.

No module imports another module's ``_private`` name (``KNOWN_PRIVATE_IMPORTS`` lists the ones that
remain to be made public).

Only ``sched`` (scheduling: queues, blocks, request counts) and ``engine`` (the step loop, inputs and
outputs) write ``Request`` attributes (``pagedllm/request.py`` says which room writes which field); every
other room reads them. The check is a practical approximation, per module that imports from
``pagedllm.request`` or ``pagedllm.sched.scheduler`` (the ways to reach a request): an expression is
taken for a request when it is a name annotated ``Request`` (or ``Request | None``), bound by
``Request(...)`` or by ``x = <...>.request``, bound by a ``for`` over a name annotated as a collection
of ``Request``, or named ``request``, ``req`` or ``shadow``; or an attribute ``.request`` or ``.shadow``
of anything. A write is an assignment, augmented assignment or ``del`` of an attribute of
such an expression (or of an item of it), a mutating call on such an attribute (``.append``,
``.extend``, ...), a call of ``Request``'s own mutating methods, or ``setattr`` on it. Aliases (``ids =
request.block_ids; ids.append(...)``) and requests reached through other names are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"
# The benchmarks: a package of their own above the runtime, which never imports them.
BENCH_PACKAGE = PACKAGE.parent / "benchmarks" / "pagedllm_bench"

LAYERS: list[set[str]] = [
    {"__init__", "__main__", "entrypoints"},
    {"engine"},
    {"sched", "worker", "distributed"},
    {"lora"},
    {"model", "sample", "spec", "structured"},
    {"attention"},
    {"kernels"},
]
SHARED = {
    "config",
    "errors",
    "inputs",
    "request",
    "sampling_params",
    "pooling_params",
    "outputs",
    "utils",
    "lora_request",
}
# The arrows between packages of one layer, pinned where they are: the worker reads the scheduler's
# output and uses the process groups; speculative decoding samples as the sampler does; the top
# layer's entry points.
SAME_LAYER_ARROWS = {
    ("__init__", "entrypoints"),
    ("__main__", "entrypoints"),
    ("entrypoints", "__init__"),
    ("worker", "sched"),
    ("worker", "distributed"),
    ("spec", "sample"),
}
# ``_private`` names still imported by other modules: (importing module, module.name). Only shrinks.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()
# Rooms that write ``Request`` attributes (besides ``pagedllm/request.py`` itself).
REQUEST_WRITERS = {"sched", "engine"}
# Modules that import from these reach requests (the type, or a scheduler output's rows).
REQUEST_SOURCES = {"pagedllm.request", "pagedllm.sched.scheduler"}
REQUEST_NAMES = {"request", "req", "shadow"}  # names taken for a request in such modules
REQUEST_ATTRIBUTES = {"request", "shadow"}  # attributes holding one (ScheduledRequest, DraftState)
MUTATING_METHODS = {
    "append",
    "extend",
    "insert",
    "pop",
    "popleft",
    "appendleft",
    "remove",
    "clear",
    "sort",
    "reverse",
    "update",
    "setdefault",
    "add",
    "discard",
    "__setitem__",
    "__delitem__",
}
REQUEST_METHODS = {"append_output_token"}  # Request's own methods that change it


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _import_nodes(module: str, source: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """``(imported module, names imported from it)`` of every import in ``source`` (relative ones
    resolved; ``import x`` imports no names)."""
    own = module.split(".")
    package = own if is_package else own[:-1]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                imported = ".".join(base + ([node.module] if node.module else []))
            else:
                imported = node.module or ""
            found.append((imported, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
    return found


def _imports_of(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every ``pagedllm`` module (or ``module.name``) the module imports."""
    found: set[str] = set()
    for imported, names in _import_nodes(module, source, is_package):
        found.update(
            n
            for n in [imported, *(f"{imported}.{name}" for name in names)]
            if n == "pagedllm" or n.startswith("pagedllm.")
        )
    return found


def _graph(sources: dict[str, tuple[str, bool]] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports; ``sources`` (module -> (source, is a package)) defaults to
    the package's own modules."""
    if sources is None:
        sources = {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        targets = set()
        for imported in _imports_of(name, source, is_package):
            # ``from pagedllm.x import y`` names either module ``pagedllm.x.y`` or an attribute of x.
            while imported not in sources and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in sources and imported != name:
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


# -- the arrows within a layer --------------------------------------------------------------------
def _same_layer_arrows(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(room, room)`` for every import between two packages of one layer."""
    arrows = set()
    for module, targets in graph.items():
        room = _module_room(module)
        for target in targets:
            other = _module_room(target)
            if "shared" not in (room, other) and room != other and _level(room) == _level(other):
                arrows.add((room, other))
    return arrows


def test_arrows_within_a_layer_are_pinned() -> None:
    new = _same_layer_arrows(_graph()) - SAME_LAYER_ARROWS
    assert not new, f"imports between packages of one layer that are not in SAME_LAYER_ARROWS: {sorted(new)}"
    # The package's __init__ exports the entry points, which import its version (modules, no cycle).
    both_ways = {
        (a, b)
        for a, b in SAME_LAYER_ARROWS
        if (b, a) in SAME_LAYER_ARROWS and {a, b} != {"__init__", "entrypoints"}
    }
    assert not both_ways, f"a pair of packages importing each other: {sorted(both_ways)}"


# Inside ``engine``: the loop and its processors (``pagedllm.engine.*``) run in any process and never
# reach for the processes' transport (``engine.proc``); what the engine tells about itself
# (``engine.observe``) depends on nothing else of the engine.
ENGINE_ROOMS = ("proc", "observe")


def _engine_room(module: str) -> str | None:
    """``loop``, ``proc`` or ``observe`` for a module of ``pagedllm.engine`` (None elsewhere)."""
    parts = module.split(".")
    if parts[:2] != ["pagedllm", "engine"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in ENGINE_ROOMS else "loop"


def _engine_breaches(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    breaches = set()
    for module, targets in graph.items():
        room = _engine_room(module)
        for target in targets:
            other = _engine_room(target)
            if room is None or other is None or room == other:
                continue
            if (room, other) in {("loop", "proc"), ("observe", "loop"), ("observe", "proc")}:
                breaches.add((module, target))
    return breaches


def test_engine_rooms_point_one_way() -> None:
    breaches = _engine_breaches(_graph())
    assert not breaches, sorted(breaches)


def test_the_runtime_never_imports_the_benchmarks() -> None:
    """``pagedllm`` runs without ``pagedllm_bench`` installed: its ``bench`` subcommand names the
    package as a string and imports it only when run."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for imported, _ in _import_nodes(_module_name(path), path.read_text(), path.name == "__init__.py"):
            if imported.split(".")[0] == "pagedllm_bench":
                wrong.append(f"{_module_name(path)} imports {imported}")
    assert not wrong, wrong
    assert (BENCH_PACKAGE / "cli.py").is_file()


# -- private names ----------------------------------------------------------------------------------
def _private_imports(module: str, source: str, is_package: bool = False) -> set[tuple[str, str]]:
    """``(module, imported.name)`` for every ``_private`` name (or module) ``module`` imports from
    another ``pagedllm`` module (dunder names aside)."""

    def private(name: str) -> bool:
        return name.startswith("_") and not name.endswith("__")

    found = set()
    for imported, names in _import_nodes(module, source, is_package):
        if not imported.startswith("pagedllm") or imported == module:
            continue
        dotted = [f"{imported}.{name}" for name in names if private(name)]
        if any(private(part) for part in imported.split(".")):
            dotted.append(imported)
        found.update((module, d) for d in dotted)
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    found: set[tuple[str, str]] = set()
    for root in (PACKAGE, BENCH_PACKAGE):
        for path in root.rglob("*.py"):
            name = _module_name(path, root)
            found |= _private_imports(name, path.read_text(), path.name == "__init__.py")
    wrong = found - KNOWN_PRIVATE_IMPORTS
    assert not wrong, "private names imported across modules:\n" + "\n".join(
        f"{m} <- {n}" for m, n in sorted(wrong)
    )


# -- who writes Request -----------------------------------------------------------------------------
def _is_request_annotation(node: ast.expr | None) -> bool:
    """``Request``, ``Request | None``, ``Optional[Request]`` (also as strings)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(node, ast.Name):
        return node.id == "Request"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is_request_annotation(node.left) or _is_request_annotation(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Optional":
        return _is_request_annotation(node.slice)
    return False


def _is_request_collection(node: ast.expr | None) -> bool:
    """``list[Request]``, ``Sequence[Request]``, ``deque[Request]`` and the like."""
    return isinstance(node, ast.Subscript) and _is_request_annotation(node.slice)


def _request_writes(module: str, source: str) -> list[str]:
    """Writes of ``Request`` attributes in ``source`` (see the module docstring), as
    ``module:line: expression``; none when the module does not import ``pagedllm.request.Request``."""
    tree = ast.parse(source)
    reaches_requests = any(
        isinstance(node, ast.ImportFrom) and node.module in REQUEST_SOURCES for node in ast.walk(tree)
    )
    if not reaches_requests:
        return []
    names = set(REQUEST_NAMES)
    collections: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg):
            if _is_request_annotation(node.annotation):
                names.add(node.arg)
            elif _is_request_collection(node.annotation):
                collections.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _is_request_annotation(node.annotation):
                names.add(node.target.id)
            elif _is_request_collection(node.annotation):
                collections.add(node.target.id)
        elif isinstance(node, ast.Assign):
            value = node.value
            built = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and value.func.id == "Request"
            )
            if built or (isinstance(value, ast.Attribute) and value.attr in REQUEST_ATTRIBUTES):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            if isinstance(node.iter, ast.Name) and node.iter.id in collections:
                names.add(node.target.id)

    def is_request(node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        return isinstance(node, ast.Attribute) and node.attr in REQUEST_ATTRIBUTES

    def written(target: ast.expr) -> bool:
        while isinstance(target, ast.Subscript):
            target = target.value
        return isinstance(target, ast.Attribute) and is_request(target.value)

    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATING_METHODS:
                targets = [func.value]
            elif isinstance(func, ast.Attribute) and func.attr in REQUEST_METHODS and is_request(func.value):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            elif (
                isinstance(func, ast.Name) and func.id == "setattr" and node.args and is_request(node.args[0])
            ):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        flat: list[ast.expr] = []
        for target in targets:
            flat += target.elts if isinstance(target, ast.Tuple) else [target]
        found += [f"{module}:{node.lineno}: {ast.unparse(t)}" for t in flat if written(t)]
    return found


def test_only_core_and_engine_write_requests() -> None:
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if _module_room(module) not in REQUEST_WRITERS and module != "pagedllm.request":
            wrong += _request_writes(module, path.read_text())
    assert not wrong, "Request attributes written outside core/ and engine/:\n" + "\n".join(sorted(wrong))


def test_layer_checks_catch_each_kind_of_breach() -> None:
    """Small synthetic sources: each check above flags its breach and lets the allowed form pass."""
    header = "from pagedllm.request import Request\n"
    through_output = "from pagedllm.sched.scheduler import SchedulerOutput\n"
    assert _request_writes(
        "pagedllm.worker.x",
        through_output + "def f(so):\n    for s in so.scheduled_requests:\n"
        "        row = s.request\n        row.prompt_logprobs.extend([])\n",
    )
    breaches = {
        "assignment": "def f(r: Request) -> None:\n    r.status = 1\n",
        "augmented": "def f(req):\n    req.num_computed_tokens += 1\n",
        "optional": "def f(r: 'Request | None') -> None:\n    r.block_ids[0] = 2\n",
        "mutating call": "def f(request):\n    request.block_ids.append(3)\n",
        "method": "def f(x: Request):\n    x.append_output_token(4)\n",
        "constructed": "s = Request('a', [1], None, 1, [])\ns.priority = 2\n",
        "attribute": "def f(step):\n    step.request.spec_token_ids = [1]\n",
        "loop": "def f(rs: list[Request]):\n    for r in rs:\n        r.prompt_logprobs.extend([])\n",
        "setattr": "def f(req):\n    setattr(req, 'status', 1)\n",
        "delete": "def f(req):\n    del req.grammar\n",
        "tuple": "def f(req):\n    req.a, b = 1, 2\n",
    }
    for kind, body in breaches.items():
        assert _request_writes("pagedllm.worker.x", header + body), kind
    reads = "def f(r: Request, other):\n    n = r.num_tokens\n    other.status = 1\n    r.params.n\n"
    assert not _request_writes("pagedllm.worker.x", header + reads)
    assert not _request_writes("pagedllm.worker.x", "def f(request):\n    request.state = 1\n")  # no Request
    sources = {
        "pagedllm.sched.a": ("from pagedllm.worker.b import B\n", False),  # against the pinned direction
        "pagedllm.worker.b": (
            "from pagedllm.sched.c import C\nfrom pagedllm.sched.a import _hidden\n",
            False,
        ),
        "pagedllm.sched.c": ("from . import a\nfrom .a import _own\n", False),
    }
    graph = _graph(sources)
    assert _same_layer_arrows(graph) - SAME_LAYER_ARROWS == {("sched", "worker")}
    engine = {
        "pagedllm.engine.loop_a": ("from pagedllm.engine.proc.client import C\n", False),
        "pagedllm.engine.observe.m": ("from pagedllm.engine.loop_a import A\n", False),
        "pagedllm.engine.proc.client": ("from pagedllm.engine.observe.m import M\n", False),
    }
    assert _engine_breaches(_graph(engine)) == {
        ("pagedllm.engine.loop_a", "pagedllm.engine.proc.client"),
        ("pagedllm.engine.observe.m", "pagedllm.engine.loop_a"),
    }
    found = set().union(*(_private_imports(m, src, pkg) for m, (src, pkg) in sources.items()))
    assert found == {
        ("pagedllm.worker.b", "pagedllm.sched.a._hidden"),
        ("pagedllm.sched.c", "pagedllm.sched.a._own"),
    }
