"""A pytest plugin for ``suite_cpu.py --by-file``: each test process appends, as each
test's setup starts, its pid, the monotonic time and the test's file to the file named by
``TANDEM_SUITE_FILES`` (one short line per write, appended: the writers never interleave)."""

from __future__ import annotations

import os
import time

import pytest

AFTER = "(pytest, after its last test)"
_last = {"file": None}  # the file this process last wrote down


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _enter(item.nodeid.split("::", 1)[0])


def pytest_sessionfinish() -> None:
    _enter(AFTER)


def _enter(file: str) -> None:
    path = os.environ.get("TANDEM_SUITE_FILES")
    if not path or file == _last["file"]:
        return
    _last["file"] = file
    line = f"{os.getpid()} {time.monotonic():.3f} {file}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
