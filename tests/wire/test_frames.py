"""wire.frames: every way a message can be malformed raises MalformedFrame."""

import logging

import msgspec
import pytest
import zmq

from tandem.wire.engine_protocol import EngineAbort, EngineRequest, SamplingParams
from tandem.wire.frames import FrameCounters, FrameSpec, MalformedFrame, peer_address

SPEC = FrameSpec("test_socket", {b"R": EngineRequest, b"A": EngineAbort}, max_frame_bytes=1024)
REQ = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=2))


def enc(x) -> bytes:
    return msgspec.msgpack.encode(x)


def test_well_formed_messages_decode():
    assert SPEC.decode([b"R", enc(REQ)]) == (b"R", REQ)
    assert SPEC.decode([b"A", enc(EngineAbort(["r1"]))]) == (b"A", EngineAbort(["r1"]))
    assert SPEC.hard_limit == 4096


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([enc(REQ)], "expected 2 frames"),
        ([b"R", enc(REQ), b"extra"], "expected 2 frames"),
        ([], "expected 2 frames"),
        ([b"X", enc(REQ)], "unknown message kind"),
        ([b"R", b"\xc1\xc1garbage"], "not msgpack"),
        ([b"R", enc({"request_id": 1})], "wrong type"),
        ([b"R", enc(EngineAbort(["r1"]))], "wrong type"),  # valid msgpack, other struct
        ([b"A", enc(REQ)], "wrong type"),
        ([b"R", b"\x00" * 1025], "exceeds the cap of 1024"),
    ],
)
def test_malformed_messages_raise_with_reason(frames, reason):
    with pytest.raises(MalformedFrame, match=reason):
        SPEC.decode(frames)


def test_counters_count_every_drop_and_log_at_most_once_per_interval(caplog):
    counters = FrameCounters(log_interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="tandem.wire.frames"):
        for _ in range(5):
            counters.record("engine_input", "tcp://10.0.0.9:4242", MalformedFrame("not msgpack"))
        counters.record("gateway_output", "unknown", "expected 2 frames")
    assert counters.snapshot() == {"engine_input": 5, "gateway_output": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "engine_input from tcp://10.0.0.9:4242: not msgpack" in lines[0]


def test_peer_address_of_tcp_frames():
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send_multipart([b"a", b"b"])
        assert pull.poll(10_000)
        assert peer_address(pull.recv_multipart(copy=False)) == "127.0.0.1"
        assert peer_address([b"plain bytes"]) == "unknown"
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()
