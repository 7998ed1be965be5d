import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    """``gpu``-marked tests skip when (and only when) torch sees no CUDA device; the reason
    shows in the summary (``-ra``). On a GPU machine they run, and a failure fails."""
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
