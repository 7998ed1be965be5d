"""benchmarks/prefill_attention.py on a machine without CUDA: says so and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script measures")
def test_without_a_gpu_the_benchmark_says_so_and_exits_0():
    script = os.path.join(ROOT, "benchmarks", "prefill_attention.py")
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "prefill_attention: no GPU (torch.cuda.is_available() is False); nothing measured"
    )
