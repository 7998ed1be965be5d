"""The project's import graph: no cycles, and every import points down.

    cluster.cli  ->  cluster.disagg  ->  cluster.engines, cluster.routing
                     cluster.gateway ->  cluster.observability
    (the Backend interface, cluster.gateway.backend, is imported from below)
    cluster  ->  workers  ->  kvtransfer, kernels  ->  scheduler, wire

Read from the source with ``ast`` (nothing is imported): every ``import``,
also those inside functions (a lazy import that closes a circle is still a
circle), except under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "scheduler", "kernels", "wire", "kvtransfer", "workers")

# what each cluster package may import from the other cluster packages
# (a name allows that module or package and everything under it)
CLUSTER_ALLOWED = {
    "cluster.cli": {"cluster"},
    "cluster.gateway": {"cluster.observability"},
    "cluster.disagg": {"cluster.engines", "cluster.routing", "cluster.gateway.backend"},
    "cluster.engines": {"cluster.observability.logging_setup"},
    "cluster.routing": {"cluster.gateway.backend"},
    "cluster.observability": {"cluster.gateway.backend", "cluster.routing.metrics"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, package: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` per imported name: ``import a.b`` -> ``("a.b", None)``,
    ``from a import b`` -> ``("a", "b")`` (``b`` a submodule or an attribute)."""
    names: list[tuple[str, str | None]] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names += [(base, a.name) for a in node.names]
        stack.extend(ast.iter_child_nodes(node))
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports. ``from pkg import submodule``
    counts as the submodule (the package's ``__init__`` is not the point)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for base, name in _imported_names(ast.parse(path.read_text()), package):
            target = f"{base}.{name}" if name and f"{base}.{name}" in modules else base
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_lower_layers_never_import_cluster():
    bad = [
        (m, t)
        for m, targets in import_graph().items()
        if not _under(m, "cluster")
        for t in targets
        if _under(t, "cluster")
    ]
    assert bad == []


def test_cluster_packages_import_only_downwards():
    bad = []
    for module, targets in import_graph().items():
        owner = next((p for p in CLUSTER_ALLOWED if _under(module, p)), None)
        if owner is None:
            continue  # cluster/__init__, __main__, or outside cluster
        for t in targets:
            if not _under(t, "cluster") or _under(t, owner):
                continue
            if not any(_under(t, allowed) for allowed in CLUSTER_ALLOWED[owner]):
                bad.append((module, t))
    assert bad == []


def test_every_cluster_module_has_a_package():
    # a module added beside the packages would escape the rules above
    flat = [
        m
        for m in _modules()
        if m.count(".") == 1 and _under(m, "cluster") and m not in CLUSTER_ALLOWED
    ]
    assert sorted(flat) == ["cluster.__main__"]


def test_the_graph_sees_imports():
    # the checks above are only as good as the graph: spot-check known edges
    graph = import_graph()
    assert "cluster.gateway.backend" in graph["cluster.disagg.ray_backend"]
    assert "cluster.cli.settings" in graph["cluster.cli.check_config"]
    assert "cluster.engines.actor" in graph["cluster.engines.pools"]  # inside a function
    assert "cluster.cli.bench" in graph["cluster.cli.main"]  # from cluster.cli import bench
