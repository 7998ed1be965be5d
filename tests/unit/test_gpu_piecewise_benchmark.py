"""benchmarks/gpu_piecewise.py without CUDA: says so and exits 0; its shapes parse."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import gpu_piecewise


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script measures")
def test_without_a_gpu_the_benchmark_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_piecewise.py", "--quick"])
    assert gpu_piecewise.main() == 0
    assert capsys.readouterr().out.strip() == (
        "gpu_piecewise: no GPU (torch.cuda.is_available() is False); nothing measured"
    )


def test_shapes_are_decodes_plus_chunk_tokens():
    assert gpu_piecewise._shapes("1+15,64+0") == [(1, 15), (64, 0)]
