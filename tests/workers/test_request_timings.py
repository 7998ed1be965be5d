"""Per-request timings an engine reports on a request's final output
(wire/engine_protocol.py, workers/engine/request_clock.py), and their
validation on the gateway's socket."""

from __future__ import annotations

import msgspec
import pytest

from tandem.wire.engine_protocol import (
    GATEWAY_OUTPUT,
    NOT_REACHED,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    RequestTimings,
    SamplingParams,
)
from tandem.wire.frames import MalformedFrame
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore


def run_until_final(core: EngineCore, request_ids: set[str]) -> dict[str, list[EngineOutput]]:
    outputs: dict[str, list[EngineOutput]] = {rid: [] for rid in request_ids}
    for _ in range(500):
        for out in core.step().outputs:
            outputs.setdefault(out.request_id, []).append(out)
        if all(o and o[-1].finished for o in outputs.values()):
            return outputs
    raise AssertionError("requests did not finish in 500 steps")


def test_final_output_carries_ordered_timings_and_nothing_else_does(tiny_model_dir):
    core = EngineCore(
        EngineConfig.from_flat(
            model=tiny_model_dir, num_kv_blocks=64, max_num_batched_tokens=16, epoch=7
        )
    )
    sp = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    # 40 tokens at a budget of 16: a chunked prefill (three steps before the first token)
    core.add_request(EngineRequest("long", list(range(3, 43)), sp))
    core.add_request(EngineRequest("short", [5, 6, 7], sp))
    core.add_request(EngineRequest("gone", [8, 9], sp))
    core.abort(["gone"])
    outputs = run_until_final(core, {"long", "short"})
    assert "gone" not in outputs
    for rid, outs in outputs.items():
        assert all(o.timings is None for o in outs[:-1]), rid
        t = outs[-1].timings
        assert (t.engine_id, t.epoch, t.role) == ("engine-0", 7, "colocated")
        assert 0 <= t.queue_s == t.scheduled_s <= t.first_token_s <= t.finished_s
        assert t.kv_load_start_s == t.kv_load_end_s == NOT_REACHED and t.kv_load_s == NOT_REACHED
        assert (t.num_kv_blocks, t.num_kv_bytes, t.num_kv_descriptors) == (0, 0, 0)
    long_t = outputs["long"][-1].timings
    # the chunked prompt needed three steps before its first token: compute > 0
    assert long_t.first_token_s > long_t.scheduled_s
    core.check_integrity()
    core.scheduler.check_integrity(idle=True)


def test_preemptions_are_counted(tiny_model_dir):
    # 6 blocks of 16: two requests growing to 60 tokens cannot both fit
    core = EngineCore(EngineConfig.from_flat(model=tiny_model_dir, num_kv_blocks=6, block_size=16))
    sp = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    core.add_request(EngineRequest("a", list(range(3, 23)), sp))
    core.add_request(EngineRequest("b", list(range(30, 50)), sp))
    outputs = run_until_final(core, {"a", "b"})
    preemptions = {rid: o[-1].timings.num_preemptions for rid, o in outputs.items()}
    assert preemptions["b"] >= 1 and core.scheduler.num_preemptions == sum(preemptions.values())
    core.check_integrity()


def _frame(timings: RequestTimings) -> list[bytes]:
    batch = EngineOutputs("e0", [EngineOutput("r", [1], finish_reason=1, timings=timings)])
    return [b"O", msgspec.msgpack.encode(batch)]


def test_timings_are_validated_on_the_gateway_socket():
    good = RequestTimings("e0", 1, "decode", finished_s=0.5, scheduled_s=0.1, num_kv_blocks=3)
    kind, batch = GATEWAY_OUTPUT.decode(_frame(good))
    assert kind == b"O" and batch.outputs[0].timings == good
    for bad in (
        msgspec.structs.replace(good, finished_s=-2.0),
        msgspec.structs.replace(good, num_kv_bytes=-1),
    ):
        with pytest.raises(MalformedFrame):
            GATEWAY_OUTPUT.decode(_frame(bad))
