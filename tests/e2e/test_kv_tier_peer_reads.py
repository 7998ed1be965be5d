"""A prefix in another engine's host KV tier, READ over real NIXL (UCX loopback):
engine A computed a prompt and its blocks went to A's host tier; engine B, routed the
same prompt, gets the prefix lent by A (``kv_tier_export``) and READs it from A's
host tier (registered with A's agent) in the prefill -> decode path, computing only
the rest. Tokens are identical to an engine that computed everything; a READ that
fails falls back to recompute; both engines pass check_integrity and no tier block
is left pinned (kvtransfer/tiers/export.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.scheduler.block_hash import hash_request_blocks
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e.engine_proc import Harness

pytestmark = pytest.mark.slow

BLOCK = 16
BASE = dict(block_size=BLOCK, max_num_batched_tokens=64, max_model_len=256)
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("tier-peer-llama"))


def _wait_stored(h: Harness, name: str, num_blocks: int) -> None:
    end = time.monotonic() + 30
    while True:
        off = h.stats(name).kv_offload
        if off.store_queue_depth == 0 and off.tiers[0].blocks >= num_blocks:
            return
        assert time.monotonic() < end, off
        time.sleep(0.05)


def test_engine_reads_a_prefix_only_another_engines_host_tier_holds(ckpt):
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 300, (70,), generator=g).tolist()  # 4 full blocks + 6
    fillers = [torch.randint(3, 300, (150,), generator=g).tolist() for _ in range(2)]
    with LLM(EngineConfig.from_flat(model=ckpt, num_kv_blocks=64, **BASE)) as ref:
        (want,) = ref.generate(prompt_token_ids=[prompt], sampling_params=SP)
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=5.0)
        h.start("A", EngineConfig.from_flat(num_kv_blocks=20, kv_offloading_size=0.01, **common))
        h.start("B", EngineConfig.from_flat(num_kv_blocks=64, **common))
        host, port = h.call("A", "kv_transfer_address")
        h.call("B", "set_prefill_endpoints", args=[[["A", 0, host, port]]])
        h.send("A", EngineRequest("a0", prompt, SP))
        h.wait_final("a0", "A")
        for i, filler in enumerate(fillers):  # push the prompt out of A's 20-block cache
            h.send("A", EngineRequest(f"f{i}", filler, SamplingParams(max_tokens=2)))
            h.wait_final(f"f{i}", "A")
        _wait_stored(h, "A", 4)
        h.wait_idle("A")
        hashes = hash_request_blocks(prompt, BLOCK, algo="sha256")
        assert len(hashes) == 4

        # B serves the prompt with A's host tier lending the 4-block prefix
        params = h.call("A", "kv_tier_export", args=[hashes])
        assert params["remote_medium"] == "host" and len(params["remote_block_ids"]) == 4
        assert params["num_tokens"] == 4 * BLOCK
        before = h.stats("B").kv_transfer.transfer_bytes_total
        h.send("B", EngineRequest("b0", prompt, SP, kv_transfer_params=params))
        last = h.wait_final("b0", "B")
        assert h.tokens("b0", "B") == want.token_ids, last
        assert h.outputs["b0"][0][1].num_cached_tokens == 4 * BLOCK  # a cache hit, remote
        block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # layers, K/V, tokens, kv heads, dim, fp32
        read = h.stats("B").kv_transfer.transfer_bytes_total - before
        assert read == 4 * block_bytes  # the prefix travelled over NIXL, from A's host tier
        a = h.wait_idle("A")  # B's "done" unpinned the export (check_integrity: no pins)
        assert a.kv_offload.tiers[0].blocks >= 4  # the blocks stay in A's tier
        h.wait_idle("B")

        # a READ that cannot work (slots past A's host tier) is recomputed, never wrong
        assert h.call("B", "reset_prefix_cache") is True  # B holds nothing of it again
        failures = h.stats("B").kv_transfer.transfer_failures_total
        bad = h.call("A", "kv_tier_export", args=[hashes])
        bad["remote_block_ids"] = [10**6 + i for i in range(4)]
        h.send("B", EngineRequest("b1", prompt, SP, kv_transfer_params=bad))
        h.wait_final("b1", "B")
        assert h.tokens("b1", "B") == want.token_ids
        assert h.outputs["b1"][0][1].num_cached_tokens == 0  # recomputed: nothing cached
        assert h.stats("B").kv_transfer.transfer_failures_total == failures + 1
        h.wait_idle("B")
        h.wait_idle("A")  # B still said "done": A's export is over, nothing pinned

        # a prefix A's host tier does not hold: nothing to lend
        assert h.call("A", "kv_tier_export", args=[[b"\x01" * 32]]) is None
        # lent but never read (the reader is gone): A's lease ends it, nothing stays pinned
        assert h.call("A", "kv_tier_export", args=[hashes]) is not None
        h.wait_idle("A", timeout_s=60)
        assert h.stats("A").kv_transfer.lease_expiries_total >= 1
    finally:
        h.close()
