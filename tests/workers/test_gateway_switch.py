"""An engine adopted by a new gateway (``EngineService.switch_gateway``,
``cluster/engines/attach.py``): the old gateway reads nothing any more (it crashed);
the switch aborts every request it had sent, frees their KV, drops the
outputs held back for it, and from then on the new gateway gets the
heartbeats and the outputs of the requests it sends."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from tandem.wire.engine_protocol import EngineOutputs, EngineRequest, FinishReason, SamplingParams
from tests.workers.test_output_backpressure import (
    NUM_REQUESTS,
    in_loop,
    send_all,
    wait_blocked,
)
from tests.workers.test_output_backpressure import served as served  # noqa: PLC0414 - fixture

pytestmark = pytest.mark.slow  # an engine loop on real sockets


def wait_stuck(service, timeout_s: float = 120.0) -> None:
    """Until outputs are held back and the engine no longer steps: the socket
    buffers behind the old gateway are full. (Right after the first held-back
    output they may still drain, on a loaded machine.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        wait_blocked(service, timeout_s=max(1.0, deadline - time.monotonic()))
        steps = in_loop(service, service.stats).num_steps
        time.sleep(0.5)
        now = in_loop(service, service.stats)
        if now.output_backlog_messages > 0 and now.num_steps == steps:
            return
        assert time.monotonic() < deadline, "the engine kept stepping: outputs still drain"


def test_switch_gateway_aborts_the_old_requests_and_serves_the_new_gateway(served, ipc_dir):
    service, old = served
    send_all(old)
    wait_stuck(service)  # the old gateway reads nothing: outputs are held back
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    addr = f"ipc://{ipc_dir}/switched"
    pull.bind(addr)
    try:
        assert in_loop(service, lambda: service.switch_gateway(addr)) == NUM_REQUESTS
        stats = in_loop(service, service.stats)
        assert stats.output_backlog_messages == 0
        assert stats.scheduler.num_running_reqs == stats.scheduler.num_waiting_reqs == 0
        assert stats.scheduler.kv_cache_usage == 0.0
        assert in_loop(service, service.engine.check_integrity)
        # the new gateway's request (sent on the same input socket) streams to it
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        old.send(EngineRequest("new-0", [5, 6, 7, 8], sp))
        dec = msgspec.msgpack.Decoder(EngineOutputs)
        tokens, final = 0, None
        deadline = time.monotonic() + 60
        while final is None:
            assert time.monotonic() < deadline, "no output reached the new gateway"
            if not pull.poll(100):
                continue
            kind, payload = pull.recv_multipart()
            if kind != b"O":
                continue
            for out in dec.decode(payload).outputs:
                assert out.request_id == "new-0", out  # nothing of the old gateway's
                tokens += len(out.new_token_ids)
                final = out.finish_reason or final
        assert tokens == 8 and final == FinishReason.LENGTH
    finally:
        pull.close(0)
        ctx.term()
