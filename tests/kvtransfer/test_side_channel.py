"""The ZMQ side channel alone (no NIXL): handshakes, refusals, notifications."""

import time

import pytest
import zmq

from tandem.kvtransfer.compat import KVLayout
from tandem.kvtransfer.nixl_meta import NotifKey
from tandem.kvtransfer.side_channel import (
    HandshakeError,
    HandshakeInfo,
    Notification,
    NotificationSender,
    RegionInfo,
    SideChannelServer,
    fetch_handshake,
)

INFO = HandshakeInfo(
    engine_id="p0",
    epoch=4,
    agent_name="tandem-p0-e4-abc",
    agent_metadata=b"\x00metadata\xff",
    compat_hash="h" * 32,
    layout=KVLayout("tiny", "float32", 2, 2, 8, 4),
    region=RegionInfo(
        base_addr=1 << 40, block_len=1024, num_blocks=32, device_id=0, mem_type="DRAM"
    ),
)


@pytest.fixture
def server():
    srv = SideChannelServer("p0", 4, "127.0.0.1", 0)
    ctx = zmq.Context()
    try:
        yield srv, ctx
    finally:
        srv.close()
        ctx.term()


def test_refuses_before_registration_then_serves_info(server):
    srv, ctx = server
    assert srv.port > 0
    with pytest.raises(HandshakeError, match="KV cache not registered"):
        fetch_handshake(ctx, "127.0.0.1", srv.port, "d0", timeout_s=5)
    srv.set_info(INFO)
    assert fetch_handshake(ctx, "127.0.0.1", srv.port, "d0", timeout_s=5) == INFO
    assert srv.num_handshakes_served == 2  # the refusal was an answer too


def test_handshake_timeout_when_nobody_listens():
    ctx = zmq.Context()
    try:
        start = time.monotonic()
        with pytest.raises(HandshakeError, match="within 0.2 s"):
            fetch_handshake(ctx, "127.0.0.1", 9, "d0", timeout_s=0.2)
        assert time.monotonic() - start < 2
    finally:
        ctx.term()


def test_notifications_arrive_in_order_for_this_incarnation_only(server):
    srv, ctx = server
    sender = NotificationSender(ctx)
    try:
        assert sender.send("127.0.0.1", srv.port, Notification("p0", 4, "renew", "a"))
        assert sender.send("127.0.0.1", srv.port, Notification("p0", 3, "done", "stale-epoch"))
        assert sender.send("127.0.0.1", srv.port, Notification("p9", 4, "done", "other-engine"))
        assert sender.send("127.0.0.1", srv.port, Notification("p0", 4, "done", "a"))
        # a decode rank's own "done" (rank 1 of 2); a rank outside its count is malformed
        assert sender.send("127.0.0.1", srv.port, Notification("p0", 4, "done", "a", 1, 2))
        assert sender.send("127.0.0.1", srv.port, Notification("p0", 4, "done", "x", 2, 2))
        received = []
        deadline = time.monotonic() + 5
        while len(received) < 3:
            assert time.monotonic() < deadline
            received += srv.drain_notifications()
            time.sleep(0.001)
        time.sleep(0.05)  # anything else would have arrived by now
        assert received + srv.drain_notifications() == [
            NotifKey("renew", "a"),
            NotifKey("done", "a"),
            NotifKey("done", "a", 1, 2),
        ]
        assert srv.malformed_frames.snapshot() == {"kv_side_channel": 1}
    finally:
        sender.close()


def test_bind_conflict_is_a_clear_error(server):
    srv, _ = server
    with pytest.raises(HandshakeError, match="bind"):
        SideChannelServer("p1", 0, "127.0.0.1", srv.port)
