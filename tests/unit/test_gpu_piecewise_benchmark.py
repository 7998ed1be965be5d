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


def test_every_timed_step_has_exactly_d_plus_c_tokens_on_one_engine():
    """One engine (budget = the largest D + C) serves every shape: ``step_ms`` raises if a
    timed step's token count is not D + C (on the GPU the first shape filled the whole
    budget with prompt tokens: "step had 512 tokens, not 1+15")."""
    from argparse import Namespace

    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    shapes = [(1, 15), (4, 28), (3, 0)]
    engine = EngineCore(
        EngineConfig.from_flat(
            model="tiny",
            max_num_seqs=max(d for d, _ in shapes) + 1,
            max_num_batched_tokens=max(d + c for d, c in shapes),
            max_model_len=256,
            num_kv_blocks=256,
            enable_prefix_caching=False,
        )
    )
    args = Namespace(steps=4, prompt_len=40)
    for decodes, chunk in shapes:
        assert gpu_piecewise.step_ms(engine, decodes, chunk, args) > 0
    assert engine.scheduler.config.long_prefill_token_threshold == 0
    engine.check_integrity()


def test_many_decodes_with_long_prompts_settle_before_the_first_finishes():
    """On the H100, 64 decodes of 512-token prompts on a 256-token budget took 128 prefill
    steps, more than ``--quick``'s old ``max_tokens`` (84): the first decodes finished before
    the last began, no step ever held all 64, and the settle loop spun until the device's
    deadline (no 64+192 row). On CUDA the engine runs the overlapped loop (the default
    there), as here; the same shape and budget on the tiny model."""
    from argparse import Namespace

    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    engine = EngineCore(
        EngineConfig.from_flat(
            model="tiny",
            max_num_seqs=65,
            max_num_batched_tokens=256,
            max_model_len=4096,  # one long prompt covers every timed chunk, as on the GPU
            num_kv_blocks=4096,
            enable_prefix_caching=False,
            async_scheduling=True,
        )
    )
    args = Namespace(steps=10, prompt_len=512)
    assert gpu_piecewise.step_ms(engine, 64, 192, args) > 0
    engine.check_integrity()
