"""benchmarks/gpu_engine.py and prefill_attention.py on a machine without CUDA say so and exit 0; the GPU session
script (benchmarks/gpu_session.sh) parses and refuses an unknown part before running anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script measures")
@pytest.mark.parametrize("name", ["gpu_engine", "prefill_attention"])
def test_without_a_gpu_the_benchmark_says_so_and_exits_0(name):
    script = os.path.join(ROOT, "benchmarks", f"{name}.py")
    done = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"{name}: no GPU (torch.cuda.is_available() is False); nothing measured"
    )


def test_the_gpu_session_script_parses_and_refuses_an_unknown_part(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
    assert subprocess.run(["bash", "-n", script], timeout=30).returncode == 0
    done = subprocess.run(
        ["bash", script, "everything"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        env={**os.environ, "OUT": str(tmp_path)},
    )
    assert done.returncode == 2 and "usage" in done.stderr and "extras" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing ran
