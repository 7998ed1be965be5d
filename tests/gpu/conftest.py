"""The workers tests' checkpoint fixtures, for the GPU tests."""

from tests.workers.conftest import make_checkpoint, tiny_model_dir  # noqa: F401
