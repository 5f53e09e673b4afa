"""The code's shape, checked: services depend only downward, no module imports itself back through others,
and no function in services/ is longer than a reader can follow (80 lines).

Layers, lowest first: common; modelkit; engine; billing and adapters; gateway; batch (the Batch API's runner,
which drives the gateway's request path); devstack; the `mplex` entry
point (services/cli.py). Every `import` counts, module-level or inside a function, except those under
`if TYPE_CHECKING:`; `from package import submodule` is an edge to the submodule, not to the package.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"
LAYERS = {"common": 0, "modelkit": 1, "engine": 2, "billing": 3, "adapters": 3, "gateway": 4, "batch": 5, "devstack": 6,
          "cli": 7}
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for p in SERVICES.rglob("*.py"):
        parts = p.relative_to(SERVICES.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name:
                    graph[name].add(t)
    return graph


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1]
    return top, LAYERS[top]


def test_services_import_only_downward():
    upward = sorted(
        f"{a} -> {b}" for a, bs in import_graph().items() for b in bs
        if _layer(a)[0] != _layer(b)[0] and _layer(b)[1] >= _layer(a)[1]
    )
    assert not upward, "imports from a lower or equal layer to another service:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                cycles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_function_in_services_is_longer_than_80_lines():
    long = []
    for path in SERVICES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SERVICES.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(sorted(long))


def test_the_checks_can_fail(tmp_path):
    """The graph sees a function-level import and a relative one (what an upward arrow would look like)."""
    graph = import_graph()
    assert "services.common.embedded" in graph["services.devstack"]  # a function-level import
    assert any(b.startswith("services.common") for b in graph["services.engine.engine"])
