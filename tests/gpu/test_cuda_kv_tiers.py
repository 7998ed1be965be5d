"""KV tiers on CUDA: the host tier is pinned and copies run on the tier thread's own
stream; greedy fp32 tokens are identical with tiers on and off while prefixes are
evicted to host and disk and loaded back (chunked prefill, preemption, the overlapped
loop), and every tier passes check_integrity."""

from __future__ import annotations

import pytest
import torch

from tandem.kvtransfer.tiers.gather import gather_enabled, gather_launches
from tests.workers.test_kv_tiers import (
    SP,
    prompts_with_shared_prefixes,
    reference,
    settle,
    tiered,
    tiers,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_cuda_tiers_give_identical_tokens(async_scheduling, tmp_path):
    prompts = prompts_with_shared_prefixes()
    want = reference("tiny", prompts, device="cuda")
    llm = tiered(
        "tiny",
        tmp_path,
        host_blocks=10,
        disk_blocks=64,
        device="cuda",
        num_kv_blocks=14,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    try:
        assert tiers(llm).host.data.is_pinned()
        for _ in range(3):
            got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
            assert [r.token_ids for r in got] == want
            settle(llm)
        stats = tiers(llm).stats()
        assert stats["host_hits"] > 0 and stats["disk_hits"] > 0, stats
        assert stats.get("load_failures", 0) == 0
        # host loads were gathered by one kernel reading the pinned slots (gather.py)
        assert gather_enabled() and gather_launches() > 0
        for p, w in zip(prompts, want, strict=True):
            (r,) = llm.generate(prompt_token_ids=[p], sampling_params=SP)
            assert r.token_ids == w and r.num_cached_tokens == 64
            settle(llm)
    finally:
        llm.close()


def test_cuda_corrupted_host_blocks_are_misses(tmp_path):
    """The host tier's check on CUDA is computed on the device (device_copies.py): a
    corrupted slot fails it, and the request recomputes with the same tokens."""
    prompts = prompts_with_shared_prefixes(4)
    want = reference("tiny", prompts, device="cuda")
    llm = tiered("tiny", tmp_path, host_blocks=64, num_kv_blocks=8, device="cuda")
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        settle(llm)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        settle(llm)
        assert tiers(llm).stats()["host_hits"] > 0
        tiers(llm).host.data.bitwise_not_()
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        assert all(r.num_cached_tokens <= 48 for r in got)
        settle(llm)
        assert tiers(llm).stats()["load_failures"] > 0
    finally:
        llm.close()
