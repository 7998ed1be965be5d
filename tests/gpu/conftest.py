"""GPU tests: compiled Triton kernels (never the interpreter), and the workers tests'
checkpoint fixtures."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from tests.kernels.triton_aot import KERNEL_MODULES
from tests.workers.conftest import make_checkpoint, tiny_model_dir  # noqa: F401

_ENV = ("TRITON_INTERPRET", "TANDEM_FORCE_TRITON")


def _reload_loaded_kernels() -> None:
    # A kernel is compiled or interpreted by how TRITON_INTERPRET reads when its module runs.
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def _triton_imported_interpreting() -> bool:
    """Whether Triton was imported with TRITON_INTERPRET=1: its own standard library
    (``tl.sum``, ...) is then interpreted for good, and kernels compiled in this process
    fail on it ("'value' object has no attribute 'dtype'")."""
    if "triton" not in sys.modules:
        return False
    import triton.language as tl

    return type(tl.standard.sum).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True, scope="package")
def compiled_triton_kernels():
    """The CPU interpreter tests set TRITON_INTERPRET=1 when pytest imports them, which in a
    whole-suite run happens before any test runs: without this the GPU tests would exercise
    the interpreter. Unset it (and TANDEM_FORCE_TRITON) for tests/gpu, re-import the kernel
    modules already loaded, and restore both afterwards. If Triton itself was imported
    interpreting (the interpreter tests in the same run), nothing here can compile: the GPU
    tests skip, saying to run ``pytest tests/gpu`` in a process of its own."""
    if _triton_imported_interpreting():
        pytest.skip(
            "Triton was imported in interpreter mode by this run's CPU interpreter tests; "
            "compiled kernels need a process of their own: run `pytest tests/gpu` separately"
        )
    saved = {key: os.environ.pop(key, None) for key in _ENV}
    _reload_loaded_kernels()
    yield
    for key, value in saved.items():
        if value is not None:
            os.environ[key] = value
    _reload_loaded_kernels()


def pytest_runtest_logreport(report):
    """Print a failing test's traceback as soon as it fails, not at the session's end: a GPU
    session's pytest may be stopped by its stage deadline before the summary is written, and
    its log must still say why each finished test failed."""
    if report.failed:
        print(f"\n==== FAILED {report.nodeid} ({report.when}, {report.duration:.1f}s)", flush=True)
        print(report.longreprtext[-6000:], flush=True)
