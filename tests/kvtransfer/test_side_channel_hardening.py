"""The side channel under hostile input: malformed messages on P's ROUTER
and in D's replies are dropped and counted; with a cluster secret a peer
without it never gets a handshake reply (so never P's agent metadata)."""

import threading
import time

import msgspec
import pytest
import zmq

from tandem.kvtransfer.nixl_meta import NotifKey
from tandem.kvtransfer.side_channel import (
    MAX_REQUEST_BYTES,
    HandshakeError,
    HandshakeRequest,
    Notification,
    NotificationSender,
    SideChannelServer,
    fetch_handshake,
)
from tandem.wire.auth import PlaneAuth, generate_secret
from tandem.wire.frames import FrameCounters
from tests.kvtransfer.test_side_channel import INFO

SECRET = generate_secret()


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture(params=[None, SECRET], ids=["plain", "curve"])
def served(request):
    """A registered side channel (plain or CURVE) and a member client context."""
    secret = request.param
    srv = SideChannelServer("p0", 4, "127.0.0.1", 0, secret=secret)
    srv.set_info(INFO)
    ctx = zmq.Context()
    auth = PlaneAuth(ctx, secret)
    try:
        yield srv, ctx, auth
    finally:
        srv.close()
        ctx.term()


def test_malformed_messages_are_counted_and_the_server_keeps_serving(served):
    srv, ctx, auth = served
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    auth.client(dealer)
    dealer.connect(f"tcp://127.0.0.1:{srv.port}")
    try:
        dealer.send_multipart([b"no-delimiter"])  # wrong frame count
        dealer.send_multipart([b"", b"a", b"b"])  # wrong frame count
        dealer.send_multipart([b"", b"\xc1garbage"])  # not msgpack
        dealer.send_multipart([b"", msgspec.msgpack.encode({"x": 1})])  # wrong type
        dealer.send_multipart([b"", b"\x90" * (MAX_REQUEST_BYTES + 1)])  # oversized
        wait_for(lambda: srv.malformed_frames.snapshot().get("kv_side_channel") == 5)
        # a real handshake and a real notification still work
        assert fetch_handshake(ctx, "127.0.0.1", srv.port, "d0", 10, auth=auth) == INFO
        sender = NotificationSender(ctx, auth)
        try:
            assert sender.send("127.0.0.1", srv.port, Notification("p0", 4, "done", "r1"))
            got: list = []
            wait_for(lambda: got.extend(srv.drain_notifications()) or got)
            assert got == [NotifKey("done", "r1")]
        finally:
            sender.close()
        assert srv.malformed_frames.snapshot() == {"kv_side_channel": 5}
        assert srv.auth.failures() == {}
    finally:
        dealer.close()


class _RefusedBeforeTheRequest(zmq.Socket):
    """A socket whose ``connect`` returns once the peer has refused its handshake as a
    protocol error (a client without CURVE, after a few retries): libzmq then ends that
    connection for good, and the request is sent after it, as on a thread that runs late."""

    def connect(self, addr):
        if not addr.startswith("tcp://"):  # the monitor's own inproc socket
            return super().connect(addr)
        monitor = self.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        try:
            result = super().connect(addr)
            assert monitor.poll(20_000), "the peer never refused the handshake"
            # until the socket has taken in that the connection is gone (reading EVENTS
            # makes it process its pending commands): it can no longer send
            deadline = time.monotonic() + 20
            while self.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                assert time.monotonic() < deadline, "the ended connection still takes messages"
                time.sleep(0.01)
            return result
        finally:
            self.disable_monitor()
            monitor.close(0)


class _RefusedFirstContext(zmq.Context):
    _socket_class = _RefusedBeforeTheRequest


def test_a_handshake_refused_before_the_request_is_sent_times_out():
    """Found under load (three test processes on two cores): the REQ socket, left without
    a connection, waited forever to send the request."""
    srv = SideChannelServer("p0", 4, "127.0.0.1", 0, secret=SECRET)
    srv.set_info(INFO)
    ctx = _RefusedFirstContext()
    outcome: list = []

    def fetch():
        try:
            fetch_handshake(ctx, "127.0.0.1", srv.port, "d-evil", 0.5, auth=PlaneAuth(ctx, None))
        except HandshakeError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=fetch, daemon=True)
    try:
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "fetch_handshake blocked in its send"
        assert len(outcome) == 1 and "no handshake reply" in str(outcome[0]), outcome
        assert srv.auth.failures().get("kv_side_channel", 0) >= 1
    finally:
        srv.close()
        if not thread.is_alive():
            ctx.destroy(linger=0)


def test_a_peer_without_the_secret_never_gets_the_handshake():
    srv = SideChannelServer("p0", 4, "127.0.0.1", 0, secret=SECRET)
    srv.set_info(INFO)
    ctx = zmq.Context()
    try:
        for intruder in (None, generate_secret()):  # no CURVE, or another cluster's secret
            auth = PlaneAuth(ctx, intruder)
            with pytest.raises(HandshakeError, match="no handshake reply"):
                fetch_handshake(ctx, "127.0.0.1", srv.port, "d-evil", 0.5, auth=auth)
        wait_for(lambda: srv.auth.failures().get("kv_side_channel", 0) >= 2)
        # notifications from a non-member never reach P either
        sender = NotificationSender(ctx, PlaneAuth(ctx, None))
        try:
            sender.send("127.0.0.1", srv.port, Notification("p0", 4, "done", "victim"))
            member = PlaneAuth(ctx, SECRET)
            assert fetch_handshake(ctx, "127.0.0.1", srv.port, "d0", 10, auth=member) == INFO
            assert srv.drain_notifications() == []
        finally:
            sender.close()
        assert srv.num_handshakes_served == 1
    finally:
        srv.close()
        ctx.term()


@pytest.mark.parametrize(
    "reply, reason",
    [
        ([b"\xc1garbage"], "not msgpack"),
        ([msgspec.msgpack.encode(HandshakeRequest(1, "x"))], "wrong type"),
        ([b"a", b"b"], "expected 1 frame"),
    ],
)
def test_decode_side_counts_a_malformed_reply(reply, reason):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    counters = FrameCounters()

    def answer():
        if router.poll(20_000):
            identity, empty, _ = router.recv_multipart()
            router.send_multipart([identity, empty, *reply])

    t = threading.Thread(target=answer)
    t.start()
    try:
        with pytest.raises(HandshakeError, match=reason):
            fetch_handshake(ctx, "127.0.0.1", port, "d0", 20, malformed=counters)
        assert counters.snapshot() == {"kv_handshake_reply": 1}
    finally:
        t.join(25)
        router.close()
        ctx.term()
