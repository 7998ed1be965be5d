"""The code's shape in numbers (issue #24's before/after table), from the source alone.

    .venv/bin/python benchmarks/structure.py            # this checkout
    .venv/bin/python benchmarks/structure.py --root DIR  # another checkout (e.g. a worktree)

Prints: source files over 500 lines, the largest classes (lines), import cycles between the
project's modules (strongly connected components of the module import graph, every import
statement counted, also those inside functions, except those under ``if TYPE_CHECKING:``;
``tests/unit/test_import_layers.py`` asserts on the same graph), upward imports (a lower layer importing a
higher one: the layer order is ``wire < scheduler, kernels < kvtransfer < workers < cluster``),
the number of options ``tandem serve --help`` lists, and the README's line count. Nothing
of the project is imported or run except ``tandem serve --help`` in a child process.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: E402  (benchmarks/checkout.py)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wire", "scheduler", "kernels", "kvtransfer", "workers", "cluster")
# a package may import those of a lower or equal rank only
RANK = {"wire": 0, "scheduler": 1, "kernels": 1, "kvtransfer": 2, "workers": 3, "cluster": 4}


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> path for every .py file of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
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


def _short(name: str) -> str:
    """Installed, the packages are ``tandem.cluster``, ...: the graph names them short."""
    return name.removeprefix("tandem.")


def bare_imports(root: Path = ROOT, extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """``(file, imported module)`` for every import of a project package by its bare
    top-level name (``import cluster``) instead of ``tandem.cluster``: installed, the bare
    name is not there (and from a checkout it would load the module a second time).
    ``extra`` adds folders (e.g. ``tests``, ``benchmarks``) to the files read."""
    files = list(source_files(root).values())
    for folder in extra:
        files += sorted((root / folder).rglob("*.py"))
    bad = []
    for path in files:
        tree = ast.parse(path.read_text())
        for base, _ in _imported_names(tree, ""):
            if base.split(".")[0] in PACKAGES:
                bad.append((str(path.relative_to(root)), base))
        bad += [(str(path.relative_to(root)), f"-m {m}") for m in _dash_m_modules(tree)]
    return bad


def _dash_m_modules(tree: ast.AST) -> list[str]:
    """Project modules a command line in the code runs bare: ``[..., "-m", "cluster", ...]``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            items = node.elts
        elif isinstance(node, ast.Call):
            items = node.args
        else:
            continue
        for a, b in zip(items, items[1:], strict=False):
            if (
                isinstance(a, ast.Constant)
                and a.value == "-m"
                and isinstance(b, ast.Constant)
                and isinstance(b.value, str)
                and b.value.split(".")[0] in PACKAGES
            ):
                found.append(b.value)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> project modules it imports. ``from pkg import submodule``
    counts as the submodule (the package's ``__init__`` is not the point)."""
    modules = source_files(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for base, name in _imported_names(ast.parse(path.read_text()), package):
            base = _short(base)
            target = f"{base}.{name}" if name and f"{base}.{name}" in modules else base
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted(
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if RANK[d.split(".")[0]] > RANK[m.split(".")[0]]
    )


def largest_classes(root: Path, top: int) -> list[tuple[int, str]]:
    sizes = []
    for module, path in source_files(root).items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                sizes.append((node.end_lineno - node.lineno + 1, f"{module}.{node.name}"))
    return sorted(sizes, reverse=True)[:top]


def serve_option_count(root: Path) -> int | None:
    cmd = [sys.executable, "-m", checkout.module(root, "cluster"), "serve", "--help"]
    done = subprocess.run(
        cmd, cwd=root, env=checkout.python_env(root), capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        return None
    # every option line of argparse's help starts with two spaces and a dash
    return len({m.group(1) for m in re.finditer(r"^\s{2,}(--[\w-]+)", done.stdout, re.M)})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    root = Path(args.root).resolve()
    files = source_files(root)
    lengths = sorted(
        ((sum(1 for _ in path.open()), str(path.relative_to(root))) for path in files.values()),
        reverse=True,
    )
    over = [(n, f) for n, f in lengths if n > 500]
    graph = import_graph(root)
    found = cycles(graph)
    upward = upward_imports(graph)
    readme = root / "README.md"
    print(f"checkout: {root}")
    print(f"source files: {len(files)}; over 500 lines: {len(over)}")
    for n, f in over:
        print(f"  {n:5d}  {f}")
    print("largest classes (lines):")
    for n, name in largest_classes(root, args.top):
        print(f"  {n:5d}  {name}")
    print(f"import cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    print(f"upward imports: {len(upward)}")
    for m, d in upward:
        print(f"  {m} -> {d}")
    print(f"`tandem serve --help` options: {serve_option_count(root)}")
    if readme.exists():
        print(f"README.md lines: {sum(1 for _ in readme.open())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
