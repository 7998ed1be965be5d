"""Run a Tandem checkout's code without installing it (benchmarks, the GPU box).

Installed, the top-level folders are ``tandem.cluster``, ``tandem.scheduler``, ...
(setup.py). A checkout that is not installed (another worktree measured beside this
one, or the GPU image, which gets the tree but no ``pip install``) is made importable
by a folder ``tandem/`` of symbolic links to the checkout's folders, put first on
``PYTHONPATH``. Checkouts from before the namespace (no setup.py) import their folders
from the root, as they always did.

    python benchmarks/checkout.py [ROOT]    # prints the PYTHONPATH entry for ROOT
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

FOLDERS = ("cluster", "scheduler", "kvtransfer", "workers", "kernels", "wire")


def namespaced(root: Path) -> bool:
    """True for checkouts whose packages install under ``tandem.``."""
    return (Path(root) / "setup.py").exists()


def module(root: Path, name: str) -> str:
    """``name`` (e.g. ``cluster.cli.main``) as the checkout at ``root`` spells it."""
    return f"tandem.{name}" if namespaced(root) else name


def path_entry(root: Path) -> str:
    """The directory to put first on ``PYTHONPATH`` to import ``root``'s code."""
    root = Path(root).resolve()
    if not namespaced(root):
        return str(root)
    digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
    shim = Path(tempfile.gettempdir()) / f"tandem-checkout-{digest}"
    package = shim / "tandem"
    package.mkdir(parents=True, exist_ok=True)
    for folder in FOLDERS:
        link = package / folder
        if not link.is_symlink():
            link.symlink_to(root / folder, target_is_directory=True)
    return str(shim)


def python_env(root: Path) -> dict[str, str]:
    """``os.environ`` with ``root``'s code first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path_entry(root), env.get("PYTHONPATH")) if p)
    return env


if __name__ == "__main__":
    print(
        path_entry(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]))
    )
