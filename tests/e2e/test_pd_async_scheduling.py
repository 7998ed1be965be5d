"""A prefill and a decode engine, both with the overlapped loop (``async_scheduling``),
real NIXL between them: a batch of handoffs gives one synchronous engine's tokens."""

from __future__ import annotations

import pytest
import torch

from tandem.kvtransfer.handoff import decode_request, prefill_request
from tandem.wire.engine_protocol import EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig
from tests.e2e.engine_proc import Harness
from tests.workers.test_async_scheduling import run

pytestmark = pytest.mark.slow

BASE = dict(block_size=16, max_num_batched_tokens=64, num_kv_blocks=96, max_model_len=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("pd-async-llama"))


def test_overlapped_prefill_and_decode_give_the_single_engine_tokens(ckpt):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 16, 40, 83, 9, 27)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=50, seed=1234),
        dict(temperature=0.9),  # unseeded: keyed by the request id on both engines
        dict(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3),
        dict(temperature=0.8, top_p=0.9, seed=7, logprobs=2),
        dict(temperature=0.0),
    ]
    requests = [
        EngineRequest(f"h{i}", p, SamplingParams(max_tokens=6 + i, ignore_eos=True, **kind))
        for i, (p, kind) in enumerate(zip(prompts, kinds))
    ]
    single, _ = run(ckpt, requests, async_scheduling=False, **BASE)

    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", async_scheduling=True)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start("D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=10.0, **common))
        for req in requests:  # every prefill at once: P batches them
            h.send("P", prefill_request(req))
        firsts = {req.request_id: h.wait_final(req.request_id, "P") for req in requests}
        for req in requests:  # every decode at once: D overlaps their steps
            assert firsts[req.request_id].finish_reason == FinishReason.LENGTH
            h.send("D", decode_request(req, firsts[req.request_id]))
        for req in requests:
            rid = req.request_id
            last = h.wait_final(rid, "D")
            assert last.finish_reason == FinishReason.LENGTH, last
            tokens = firsts[rid].new_token_ids + h.tokens(rid, "D")
            assert tokens == single[(rid, 0)].tokens, rid
        h.wait_idle("P")
        h.wait_idle("D")
    finally:
        h.close()
