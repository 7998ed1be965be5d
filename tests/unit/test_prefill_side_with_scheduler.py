"""The real NIXL scheduler side inside a real Scheduler (no worker, no NIXL):
what a prefill engine hands to the decode engine."""

from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
from tandem.scheduler import Request, Scheduler, SchedulerConfig
from tandem.scheduler.messages import KVConnectorOutput
from tandem.wire.engine_protocol import FinishReason, SamplingParams
from tests.unit.fakes import FakeRunner, step


def make():
    conn = NixlSchedulerSide(KVTransferConfig(role="prefill", engine_id="p0", block_size=4))
    cfg = SchedulerConfig(
        num_kv_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64
    )
    return Scheduler(cfg, conn), conn


def prefill(s, runner, rid, tokens):
    s.add_request(
        Request(
            rid, tokens, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True}
        )
    )
    _, eo = step(s, runner)
    (out,) = eo.outputs
    assert out.finish_reason == FinishReason.LENGTH
    return out.kv_transfer_params


def test_prefix_hit_on_prefill_still_sends_every_block():
    s, conn = make()
    r = FakeRunner()
    shared = list(range(100, 112))  # 3 full blocks
    first = prefill(s, r, "a", shared + [1, 2])
    second = prefill(s, r, "b", shared + [3, 4, 5])  # hits a's 3 blocks locally
    assert s.requests["b"].num_cached_tokens == 12
    assert second["remote_block_ids"][:3] == first["remote_block_ids"][:3]
    assert len(second["remote_block_ids"]) == 4 and second["num_tokens"] == 15
    # 4 blocks per request, 3 of them shared: 5 distinct blocks stay out of the pool
    assert s.num_blocks_held_for_transfer() == 8 and s.kv.num_free_blocks == 32 - 5
    r.kv_output = KVConnectorOutput(finished_sending=["a", "b"])
    step(s, r)
    s.check_integrity()


def test_short_prompt_sends_its_partial_block_and_frees_on_done():
    s, conn = make()
    r = FakeRunner()
    params = prefill(s, r, "short", [7, 8])
    assert params["remote_block_ids"] == [0] and params["num_tokens"] == 2
    assert params["remote_engine_id"] == "p0" and params["lease_remaining_s"] == 60.0
    r.kv_output = KVConnectorOutput(finished_sending=["short"])
    step(s, r)
    s.check_integrity()
