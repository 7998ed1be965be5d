"""The code's shape in numbers (issue #24's before/after table), from the source alone.

    .venv/bin/python benchmarks/structure.py            # this checkout
    .venv/bin/python benchmarks/structure.py --root DIR  # another checkout (e.g. a worktree)

Prints: source files over 500 lines, the largest classes (lines), import cycles between the
project's modules (strongly connected components of the module import graph, every import
statement counted, also those inside functions, except those under ``if TYPE_CHECKING:``), upward imports (a lower layer importing a
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

PACKAGES = ("wire", "scheduler", "kernels", "kvtransfer", "workers", "cluster")
# a package may import those of a lower or equal rank only
RANK = {"wire": 0, "scheduler": 1, "kernels": 1, "kvtransfer": 2, "workers": 3, "cluster": 4}


def _prefix(root: Path) -> str:
    """The packages' import prefix: "" for top-level packages, "tandem." when installed under
    one namespace (a ``tandem`` folder or ``package-dir`` mapping holding them)."""
    return "tandem." if (root / "tandem" / "__init__.py").exists() else ""


def source_files(root: Path) -> dict[str, Path]:
    """Module name -> path for every .py file of the project's packages."""
    modules = {}
    base = root / "tandem" if _prefix(root) else root
    for package in PACKAGES:
        for path in sorted((base / package).rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Project modules ``module`` imports (the longest known prefix of each name)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = set()
    # imports under ``if TYPE_CHECKING:`` never run: annotations only, not an edge
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names = [stem] + [f"{stem}.{a.name}" for a in node.names]
        for name in names:
            name = name.removeprefix("tandem.")
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = source_files(root)
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        deps = imports_of(path, module, known)
        # a module importing its own package's __init__ (or vice versa) is not a cycle of
        # design: the package is the module's container
        graph[module] = {d for d in deps if not module.startswith(d + ".")}
    return graph


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
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, "-m", "cluster", "serve", "--help"]
    if _prefix(root):
        cmd = [sys.executable, "-m", "tandem.cluster", "serve", "--help"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
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
