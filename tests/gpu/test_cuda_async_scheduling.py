"""The overlapped loop (``async_scheduling``) on a CUDA device: the synchronous loop's
tokens with decode graphs replaying (greedy, seeded, unseeded, stop tokens, aborts,
penalties), and an overlapped decode turn makes at most one synchronising call (the
previous step's tokens, read from pinned memory after their event). Skipped without CUDA
(tests/conftest.py)."""

from __future__ import annotations

import pytest

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.engine.core import EngineCore
from tests.gpu.test_cuda_engine import _config, _syncs_of_one_step
from tests.workers.test_async_scheduling import _prompts, _req, run, same_outputs

pytestmark = pytest.mark.gpu

CUDA = dict(device="cuda", dtype="float32", block_size=16, num_kv_blocks=128)


def test_overlapped_equals_synchronous_on_the_gpu(make_checkpoint):
    path = make_checkpoint("llama")
    prompts = _prompts([5, 17, 40, 3, 64, 9])
    plain, _ = run(path, [_req(f"r{i}", p, max_tokens=10, temperature=0.0, ignore_eos=True)
                          for i, p in enumerate(prompts)], async_scheduling=False, **CUDA)  # fmt: skip
    requests = [
        _req("r0", prompts[0], max_tokens=10, temperature=0.0, ignore_eos=True,
             stop_token_ids=[plain[("r0", 0)].tokens[3]]),
        _req("r1", prompts[1], max_tokens=10, temperature=0.8, top_p=0.9, seed=7,
             ignore_eos=True),
        _req("r2", prompts[2], max_tokens=10, temperature=1.0, ignore_eos=True),
        _req("r3", prompts[3], max_tokens=10, temperature=0.0, repetition_penalty=1.3,
             ignore_eos=True),
        _req("r4", prompts[4], max_tokens=10, temperature=0.7, logprobs=2, seed=1,
             ignore_eos=True),
        _req("r5", prompts[5], max_tokens=10, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    _, engine = same_outputs(path, requests, abort_at={"r5": 4}, **CUDA)
    assert engine.runner.graphs is not None
    assert sum(engine.runner.graphs.num_replays.values()) > 0


def test_overlapped_decode_turn_syncs_at_most_once(make_checkpoint):
    engine = EngineCore(_config(make_checkpoint("llama"), cuda_graph_sizes=[4],
                                async_scheduling=True))  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 9, 3)):
        assert engine.add_request(EngineRequest(f"r{i}", list(range(3, 3 + n)), params)) is None
    graphs = engine.runner.graphs
    while graphs.num_replays[4] < 2:
        engine.step()
    assert engine.scheduler.num_steps_in_flight == 1
    syncs = _syncs_of_one_step(engine)
    assert len(syncs) <= 1, syncs
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    engine.shutdown()
