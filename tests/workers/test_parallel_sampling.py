"""Parallel sampling on a real engine (scheduler/fork.py + the runner's block
copies): n children equal n independent requests, token for token, and the
forked partial block holds the parent's KV."""

from __future__ import annotations

import sys

import msgspec
import pytest
import torch
from torch.overrides import TorchFunctionMode

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore

BLOCK = 16
BASE = dict(block_size=BLOCK, max_num_batched_tokens=64, num_kv_blocks=96, max_model_len=512)


def run(engine: EngineCore, requests: list[EngineRequest]) -> dict[tuple[str, int], list[int]]:
    """Every request to the end; tokens per (request id, choice index)."""
    for r in requests:
        assert engine.add_request(r) is None
    tokens: dict[tuple[str, int], list[int]] = {}
    finished = set()
    for _ in range(2000):
        if not engine.has_work():
            break
        for o in engine.step().outputs:
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                assert (o.request_id, o.index) not in finished
                finished.add((o.request_id, o.index))
    assert finished == set(tokens)
    engine.check_integrity()
    return tokens


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    path = make_checkpoint("llama", tmp_path_factory.mktemp("fork-llama"))
    return EngineCore(EngineConfig.from_flat(model=path, **BASE))


def prompt_of(num_tokens: int, seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (num_tokens,), generator=g).tolist()


@pytest.mark.parametrize("num_prompt", [1, 2 * BLOCK + 1, 3 * BLOCK + 9, 70])
def test_seeded_children_equal_independent_requests(engine, num_prompt):
    prompt = prompt_of(num_prompt)
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    forked = run(engine, [EngineRequest("f", prompt, sp, n=3)])
    alone = run(
        engine,
        [
            EngineRequest(f"a{i}", prompt, msgspec.structs.replace(sp, seed=1234 + i))
            for i in range(3)
        ],
    )
    assert [forked[("f", i)] for i in range(3)] == [alone[(f"a{i}", 0)] for i in range(3)]
    assert len({tuple(forked[("f", i)]) for i in range(3)}) == 3  # three distinct streams


def test_greedy_children_are_identical_and_equal_n1(engine):
    prompt = prompt_of(3 * BLOCK + 5, seed=4)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    forked = run(engine, [EngineRequest("g", prompt, sp, n=3)])
    single = run(engine, [EngineRequest("s", prompt, sp)])
    assert forked[("g", 0)] == forked[("g", 1)] == forked[("g", 2)] == single[("s", 0)]


class _TensorsBuiltOnDevice(TorchFunctionMode):
    """``torch.tensor(list, device=...)`` calls by the model runner: pageable host memory
    copied to the device, which on CUDA waits for every queued kernel. The runner builds
    its index tensors through pinned memory instead (``kernels.metadata.list_to_device``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        caller = sys._getframe(1).f_code.co_filename
        if getattr(func, "__name__", "") == "tensor" and (kwargs or {}).get("device"):
            if caller.endswith(("model_runner.py", "step_forward.py", "step_planning.py")):
                self.calls.append(f"tensor(device={kwargs['device']}) in {caller}")
        return func(*args, **(kwargs or {}))


def test_the_copied_block_holds_the_parents_kv(engine):
    prompt = prompt_of(2 * BLOCK + 7, seed=5)  # the parent computes 38 tokens: 6 in block 2
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert engine.add_request(EngineRequest("c", prompt, sp, n=3)) is None
    sched = engine.scheduler
    so = sched.schedule()
    sched.update_from_output(so, engine.runner.execute(so))  # the parent's prefill; fork
    so = sched.schedule()
    assert len(so.copy_block_ids) == 2
    src = so.copy_block_ids[0][0]
    before = engine.kv_cache[src, :, :, :6].clone()
    with _TensorsBuiltOnDevice() as built:
        out = engine.runner.execute(so)
    assert built.calls == [], built.calls  # on CUDA each would be a hidden host wait
    sched.update_from_output(so, out)
    for _src, d in so.copy_block_ids:
        assert torch.equal(engine.kv_cache[d, :, :, :6], before)
    assert torch.equal(engine.kv_cache[src, :, :, :6], before)
    # 2 shared blocks: 3 references each
    table = sched.kv.get_block_ids("c#1")
    assert [sched.kv.pool.blocks[b].ref_cnt for b in table[:2]] == [3, 3]
    while engine.has_work():
        engine.step()
    engine.check_integrity()
