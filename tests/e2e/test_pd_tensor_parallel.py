"""Prefill and decode engines of different tensor-parallel sizes, each rank
its own NIXL agent (kvtransfer/tp_plan.py), in separate processes: tokens
equal one TP=1 engine's, and a decode engine's ranks read every head of
every block the handoff names exactly once (the engine's bytes sum its ranks')."""

from __future__ import annotations

import pytest
import torch

from tandem.wire.engine_protocol import EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e import test_pd_engines
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import handoff, kv_bytes

pytestmark = pytest.mark.slow

BLOCK = 16
BASE = dict(block_size=BLOCK, max_num_batched_tokens=64, num_kv_blocks=64, max_model_len=256)
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x K/V x slots x 2 KV heads x head_dim x fp32

ckpt = test_pd_engines.ckpt  # the same module-scoped llama checkpoint fixture


@pytest.fixture(scope="module")
def engines(ckpt):
    """P1, P2 (prefill at TP 1 and 2) and D2 (decode at TP 2). (P TP 2, D TP 1)
    runs through the real service in tests/cluster/test_tp_pd_service.py."""
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=10.0, torch_threads=1)
        h.start_all(
            {
                f"{role[0].upper()}{tp}": EngineConfig.from_flat(
                    role=role, tensor_parallel_size=tp, **common
                )
                for role, tp in (("prefill", 1), ("prefill", 2), ("decode", 2))
            }
        )
        yield h
    finally:
        h.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 2)])
def test_tokens_and_bytes_across_tp_sizes(engines, ckpt, p_tp, d_tp):
    g = torch.Generator().manual_seed(10 * p_tp + d_tp)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 3 * BLOCK + 7)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    single = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
        prompt_token_ids=prompts, sampling_params=sp
    )
    p, d = f"P{p_tp}", f"D{d_tp}"
    for i, prompt in enumerate(prompts):
        before = kv_bytes(engines, d)
        toks, last, params = handoff(engines, f"tp{p_tp}{d_tp}-{i}", prompt, sp, p=p, d=d)
        assert toks == single[i].token_ids
        assert last.finish_reason == FinishReason.LENGTH
        num_blocks = -(-len(prompt) // BLOCK)
        assert len(params["remote_block_ids"]) == num_blocks
        # every head of every block read once, over the decode engine's ranks
        assert kv_bytes(engines, d) - before == num_blocks * BLOCK_BYTES
    engines.wait_idle(p)
    engines.wait_idle(d)


def test_partial_prefix_hit_reads_only_missing_blocks(engines):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (2 * BLOCK,), generator=g).tolist()
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engines.send("D2", EngineRequest("warm-tp", shared + [7], sp))
    engines.wait_final("warm-tp", "D2")
    prompt = shared + torch.randint(3, 300, (BLOCK + 4,), generator=g).tolist()
    before = kv_bytes(engines, "D2")
    toks, _, params = handoff(engines, "hit-tp", prompt, sp, p="P2", d="D2")
    assert len(params["remote_block_ids"]) == 4 and len(toks) == 3
    assert kv_bytes(engines, "D2") - before == 2 * BLOCK_BYTES  # blocks 2 and 3 only
    engines.wait_idle("P2")
    engines.wait_idle("D2")
