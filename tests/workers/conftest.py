"""Shared fixtures for worker tests: random HF checkpoints in tmp dirs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.workers import hf_checkpoints


@pytest.fixture
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory ``make_checkpoint(arch, **overrides) -> path`` (see ``hf_checkpoints``)."""

    def factory(arch: str, **overrides: Any) -> str:
        out_dir = tmp_path_factory.mktemp(f"ckpt-{arch}")
        return hf_checkpoints.make_checkpoint(arch, out_dir, **overrides)

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The built-in tiny checkpoint, written into a test-private cache dir."""
    from tandem.workers.checkpoints.tiny import ensure_tiny_model

    return ensure_tiny_model(str(tmp_path_factory.getbasetemp() / "tandem-cache"))
