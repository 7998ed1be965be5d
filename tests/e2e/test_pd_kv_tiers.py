"""KV tiers on a prefill engine under P/D (kvtransfer/tiers/chain.py): a prompt the
prefill engine evicted from its device cache comes back from its host tier instead
of being computed, counts as cached tokens on P's first output, and the decode
engine still reads it over real NIXL: tokens identical, both engines pass
check_integrity."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import handoff

pytestmark = pytest.mark.slow

BASE = dict(block_size=16, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("pd-tiers-llama"))


def test_prefill_tier_hit_is_cached_tokens_and_decode_reads_it(ckpt):
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=5.0)
        h.start(
            "P",
            EngineConfig.from_flat(
                role="prefill", num_kv_blocks=20, kv_offloading_size=0.01, **common
            ),
        )
        h.start("D", EngineConfig.from_flat(role="decode", num_kv_blocks=64, **common))
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(3, 300, (70,), generator=g).tolist()
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        toks, first, _ = handoff(h, "a0", prompt, sp)
        assert h.outputs["a0"][0][1].num_cached_tokens == 0
        h.wait_idle("P"), h.wait_idle("D")
        for i in range(2):  # other prompts push it out of P's 20-block device cache
            filler = torch.randint(3, 300, (150,), generator=g).tolist()
            h.send("P", EngineRequest(f"f{i}", filler, SamplingParams(max_tokens=2)))
            h.wait_final(f"f{i}", "P")
        end = time.monotonic() + 30
        while True:
            off = h.stats("P").kv_offload
            if off.store_queue_depth == 0 and off.tiers[0].blocks >= 4:
                break
            assert time.monotonic() < end, off
            time.sleep(0.05)
        toks2, _, _ = handoff(h, "a1", prompt, sp)
        assert toks2 == toks
        p_first = next(o for eid, o in h.outputs["a1"] if eid == "P")
        assert p_first.num_cached_tokens == 64  # 4 blocks from P's host tier
        p = h.wait_idle("P")
        assert p.kv_offload.tiers[0].hits_total >= 3  # (a block may still be on the device)
        assert p.kv_transfer is not None  # the NIXL side still reports
        h.wait_idle("D")
    finally:
        h.close()


def test_decode_engine_holding_the_prompt_in_its_tier_skips_the_read(ckpt):
    """A decode engine that served a prompt before has it in its own host tier: the
    next handoff of that prompt loads the tier instead of READing P's blocks (P hears
    "done" at once and frees them); tokens identical, both engines idle and whole."""
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=5.0)
        h.start("P", EngineConfig.from_flat(role="prefill", num_kv_blocks=64, **common))
        h.start(
            "D",
            EngineConfig.from_flat(
                role="decode", num_kv_blocks=20, kv_offloading_size=0.01, **common
            ),
        )
        g = torch.Generator().manual_seed(4)
        prompt = torch.randint(3, 300, (64,), generator=g).tolist()  # 4 full blocks
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        toks, _, _ = handoff(h, "a0", prompt, sp)
        h.wait_idle("P"), h.wait_idle("D")
        read = h.stats("D").kv_transfer.transfer_bytes_total
        assert read > 0
        for i in range(2):  # push the prompt out of D's 20-block device cache
            filler = torch.randint(3, 300, (150,), generator=g).tolist()
            h.send("D", EngineRequest(f"f{i}", filler, SamplingParams(max_tokens=2)))
            h.wait_final(f"f{i}", "D")
        end = time.monotonic() + 30
        while True:
            off = h.stats("D").kv_offload
            if off.store_queue_depth == 0 and off.tiers[0].blocks >= 4:
                break
            assert time.monotonic() < end, off
            time.sleep(0.05)
        hits = h.stats("D").kv_offload.tiers[0].hits_total
        toks2, _, _ = handoff(h, "a1", prompt, sp)
        assert toks2 == toks
        d = h.wait_idle("D")
        assert d.kv_transfer.transfer_bytes_total == read  # no READ this time
        assert d.kv_offload.tiers[0].hits_total >= hits + 3  # (a block may be on the device)
        h.wait_idle("P")  # its held blocks were freed by D's "done"
    finally:
        h.close()


@pytest.mark.parametrize("p_tier", [True, False], ids=["p-with-tier", "p-without-tier"])
def test_prefill_engine_borrows_a_decode_engines_host_tier_before_it_prefills(ckpt, p_tier):
    """P (host tier, kv role "both"; or, without a tier, ``kv_borrows_tiers``: the bare
    NIXL connector as "both") lacks a prefix D's host tier holds: D lends it
    (``kv_tier_export``), P READs it over NIXL with ``do_remote_decode`` beside the lent
    params, computes only the rest (cached tokens = the lent blocks) and hands the whole
    prompt off to D as usual: tokens identical to one engine's. A lent READ that fails
    is recomputed on P, and the handoff still works. Nothing stays pinned."""
    from tandem.kvtransfer.handoff import decode_request, prefill_request
    from tandem.scheduler.block_hash import hash_request_blocks
    from tandem.workers.engine.llm import LLM

    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(3, 300, (64,), generator=g).tolist()  # 4 full blocks
    prompt = prefix + torch.randint(3, 300, (40,), generator=g).tolist()
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(EngineConfig.from_flat(model=ckpt, num_kv_blocks=64, **BASE)) as ref:
        (want,) = ref.generate(prompt_token_ids=[prompt], sampling_params=sp)
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=5.0)
        tier = dict(num_kv_blocks=64, kv_offloading_size=0.01, **common)
        if p_tier:
            h.start("P", EngineConfig.from_flat(role="prefill", **tier))
        else:  # no tier of its own: it reads as well as serves all the same
            h.start("P", EngineConfig.from_flat(role="prefill", num_kv_blocks=64,
                                                kv_borrows_tiers=True, **common))  # fmt: skip
        h.start("D", EngineConfig.from_flat(role="decode", **tier))
        host, port = h.call("D", "kv_transfer_address")  # a decode engine with a tier serves
        h.call("P", "set_prefill_endpoints", args=[[["D", 0, host, port]]])
        h.send("D", EngineRequest("d0", prefix + [7], SamplingParams(max_tokens=1)))
        h.wait_final("d0", "D")
        end = time.monotonic() + 30
        while h.stats("D").kv_offload.tiers[0].blocks < 4:  # D's host tier holds the prefix
            assert time.monotonic() < end, h.stats("D").kv_offload
            time.sleep(0.05)
        hashes = hash_request_blocks(prefix, 16, algo="sha256")

        block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, tokens, kv heads, dim, fp32
        for rid, bad in (("a0", False), ("a1", True)):
            assert h.call("P", "reset_prefix_cache") is True  # P holds nothing of it
            lent = h.call("D", "kv_tier_export", args=[hashes])
            assert lent["remote_medium"] == "host" and lent["num_tokens"] == 64
            if bad:  # slots past D's host tier: P's READ fails, P recomputes
                lent["remote_block_ids"] = [10**6 + i for i in range(4)]
            req = EngineRequest(rid, prompt, sp)
            p_req = msgspec.structs.replace(
                prefill_request(req), kv_transfer_params={**lent, "do_remote_decode": True}
            )
            read = h.stats("P").kv_transfer.transfer_bytes_total
            h.send("P", p_req)
            first = h.wait_final(rid, "P")
            assert first.num_cached_tokens == (0 if bad else 64)  # the lent blocks
            assert first.kv_transfer_params["num_tokens"] == len(prompt)  # the whole prompt
            if not bad:  # the prefix travelled over NIXL from D's host tier
                assert h.stats("P").kv_transfer.transfer_bytes_total - read == 4 * block_bytes
            h.send("D", decode_request(req, first))
            h.wait_final(rid, "D")
            assert first.new_token_ids + h.tokens(rid, "D") == want.token_ids
            d = h.wait_idle("D")  # P's "done" ended D's export: nothing pinned
            assert d.kv_transfer.sends_blocks_held == 0
            h.wait_idle("P")

        # lent, then aborted on P (before, during or after its READ): nothing stays
        # pinned on D, nothing held on P
        assert h.call("P", "reset_prefix_cache") is True
        lent = h.call("D", "kv_tier_export", args=[hashes])
        req = EngineRequest("a2", prompt, sp)
        h.send(
            "P",
            msgspec.structs.replace(
                prefill_request(req), kv_transfer_params={**lent, "do_remote_decode": True}
            ),
        )
        h.abort("P", "a2")
        assert h.wait_idle("D").kv_transfer.sends_blocks_held == 0
        assert h.wait_idle("P").kv_transfer.sends_blocks_held == 0
    finally:
        h.close()
