import gc
import logging
import os
import re
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


# Every process the tests start runs torch on one thread unless the caller chose otherwise.
# The suite runs two test processes (``make test``), each with engine, gateway and Ray
# processes beside it, on a machine of two cores: torch's default (a thread per core in
# every process) oversubscribes it, and OpenMP's spinning threads then wait on each other.
# A tiny-model generation measured 0.17 s with one thread and 8 s with two while other
# test processes ran. Set here, before torch is imported, so child processes inherit it.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
if "torch" in sys.modules:  # imported before this file (a plugin): set it there too
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two worker processes) each worker gets its own
    Ray temp dir: a Ray started by a test then never finds, joins or cleans up the other
    worker's (``ray.init()`` looks for a running cluster under the temp dir), and their
    session folders and sockets never collide."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        base = os.environ.get("RAY_TMPDIR", "/tmp")
        os.environ["RAY_TMPDIR"] = os.path.join(base, f"ray-{worker}")
        os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)


@pytest.fixture
def ipc_dir():
    """A short directory for a test's ZMQ ``ipc://`` endpoints (a Unix socket's path holds
    107 bytes at most), removed after the test: libzmq leaves a bound endpoint's socket file
    behind when the socket closes."""
    path = tempfile.mkdtemp(prefix="tandem-ipc-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# what marks a module that may start Ray (or a service, a gateway process) on its own
_RAY_OF_ITS_OWN = re.compile(
    r"\bray\b|ServiceThread|cmd_serve|GatewayProcess|chaos_service|Cluster\(|\"serve\""
)


@pytest.fixture(autouse=True, scope="module")
def _shared_ray_only_where_marked(request):
    """Modules marked ``shared_ray`` reuse the test process's plain local Ray
    (``tests/shared_ray.py``). A module that may start Ray, a service or a gateway process of its
    own (its source names one) starts with none running, as it would alone; a module that never
    touches Ray leaves the shared one up for the next."""
    shared = sys.modules.get("tests.shared_ray")
    if shared is not None and request.node.get_closest_marker("shared_ray") is None:
        with open(request.module.__file__, encoding="utf-8") as f:
            if _RAY_OF_ITS_OWN.search(f.read()):
                shared.stop()
    yield


# Modules imported when the last freeze ran (``_long_lived_heap_frozen``).
_FROZEN_AT_MODULES = [0]
# A freeze once this many more modules are loaded: a library's import (torch, transformers,
# Ray, FastAPI each bring hundreds), not a test module's own few.
_FREEZE_AFTER_NEW_MODULES = 50


@pytest.fixture(autouse=True, scope="module")
def _long_lived_heap_frozen():
    """After a test module, if it imported libraries, collect and freeze the test process's
    heap (``gc.freeze``), as ``tandem serve``'s gateway freezes its startup heap
    (``cluster/gateway/heap.py``).

    A test process holds the objects of every library it imported (torch, transformers,
    Ray's driver, FastAPI: a million and more), and CPython's full collections walk all of
    them: each took 0.2-0.4 s of CPU on the 2-core box, and the in-process engines,
    gateways and clients of the tests that follow trigger one every few seconds. Frozen,
    those objects are left out of every collection (reference counting still frees them);
    what a test allocates afterwards is collected as before. The collection before the
    freeze keeps any garbage of the module that ended out of it."""
    yield
    if len(sys.modules) >= _FROZEN_AT_MODULES[0] + _FREEZE_AFTER_NEW_MODULES:
        gc.collect()
        gc.freeze()
        _FROZEN_AT_MODULES[0] = len(sys.modules)


def pytest_unconfigure(config):
    """The frozen objects back in the collector's care, so the interpreter's last collection
    at exit finalizes them as it would without the freeze."""
    gc.unfreeze()


def pytest_sessionfinish(session, exitstatus):
    shared = sys.modules.get("tests.shared_ray")
    if shared is not None:
        shared.stop()


def pytest_collection_modifyitems(config, items):
    """Files with ``slow`` tests first, then ``long`` files, each file's tests in their
    order: ``make test``'s two workers take whole files in this order (``--dist loadfile``),
    so the long files start early and the short ones fill in at the end, instead of one
    worker finishing a long file alone while the other has nothing left (the last file
    collected, tests/workers/test_verify_graphs.py, runs 70 s).

    ``gpu``-marked tests skip when (and only when) torch sees no CUDA device; the reason
    shows in the summary (``-ra``). On a GPU machine they run, and a failure fails."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    long_files = {item.path for item in items if item.get_closest_marker("long") is not None}
    # stable: the order kept within each group
    items.sort(key=lambda item: (item.path not in slow_files, item.path not in long_files))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: no CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Put the root logger back as the test found it.

    A test that runs a CLI entry point in-process (``cmd_serve``,
    ``cluster.cli.main``) gets ``configure_logging``: the root's handlers
    replaced by one writing to the test's captured ``sys.stderr``, level
    INFO. Pytest closes that stream when the test ends, so every later record
    from any thread (the gateway's loop logging a finished request, httpx)
    fails with "--- Logging error ---", and the INFO level leaks into every
    later test. Pytest's own capture handlers come and go with each phase and
    are left to pytest."""
    root = logging.getLogger()
    handlers = [h for h in root.handlers if not _is_pytest_handler(h)]
    level = root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers and not _is_pytest_handler(handler):
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


def _is_pytest_handler(handler: logging.Handler) -> bool:
    return type(handler).__module__.split(".")[0] == "_pytest"
