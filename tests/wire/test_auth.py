"""wire.auth: only holders of the cluster secret complete a CURVE handshake;
every other peer is refused, counted, and delivers nothing."""

import time

import pytest
import zmq

from tandem.wire.auth import CurveKeys, PlaneAuth, generate_secret, read_secret_file
from tandem.workers.config import EngineConfig

SECRET = b"s" * 32


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def server():
    """A CURVE PULL server and a second context for clients."""
    ctx, clients = zmq.Context(), zmq.Context()
    auth = PlaneAuth(ctx, SECRET)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    auth.server(pull, "engine_input")
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sockets = []

    def connect(secret=None, keys=None):
        sock = clients.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
        else:
            PlaneAuth(clients, secret).client(sock)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sockets.append(sock)
        return sock

    try:
        yield auth, pull, connect
    finally:
        for s in sockets:
            s.close()
        pull.close()
        auth.close()
        ctx.term()
        clients.term()


def drain(pull, wait_ms=0):
    got = []
    while pull.poll(wait_ms):
        got.append(pull.recv())
        wait_ms = 0
    return got


def test_member_is_admitted(server):
    auth, pull, connect = server
    connect(SECRET).send(b"hello")
    assert pull.poll(20_000) and pull.recv() == b"hello"
    assert auth.failures() == {}


@pytest.mark.parametrize("peer", ["plain", "other_secret", "right_server_key_own_client_key"])
def test_non_member_is_refused_counted_and_delivers_nothing(server, peer):
    auth, pull, connect = server
    if peer == "plain":
        intruder = connect(None)
    elif peer == "other_secret":
        intruder = connect(generate_secret())
    else:  # knows the server's public key (not a secret) but not the client key
        public, secret = zmq.curve_keypair()
        intruder = connect(keys=(CurveKeys.derive(SECRET).server_public, public, secret))
    intruder.send(b"intruder")
    wait_for(lambda: auth.failures().get("engine_input", 0) >= 1)
    connect(SECRET).send(b"member")
    assert pull.poll(20_000)
    assert drain(pull) == [b"member"]
    assert drain(pull, wait_ms=200) == []  # the intruder's message never arrives


def test_keys_are_derived_deterministically_and_differ_per_secret():
    a, b = CurveKeys.derive(SECRET), CurveKeys.derive(SECRET)
    assert a.server_public == b.server_public and a.client_secret == b.client_secret
    assert a.server_public != a.client_public
    assert CurveKeys.derive(b"t" * 32).server_public != a.server_public
    assert "s" * 8 not in repr(a)


def test_secret_file_and_config_validation(tmp_path):
    good = tmp_path / "secret"
    good.write_bytes(b"  0123456789abcdef0123\n")
    assert read_secret_file(str(good)) == b"0123456789abcdef0123"
    short = tmp_path / "short"
    short.write_bytes(b"tooshort")
    with pytest.raises(ValueError, match="cluster-secret-file .*at least 16 bytes, got 8"):
        read_secret_file(str(short))
    with pytest.raises(ValueError, match="EngineConfig.cluster_secret"):
        EngineConfig.from_flat(cluster_secret=b"short")
    assert "cluster_secret" not in repr(EngineConfig.from_flat(cluster_secret=SECRET))


def test_disabled_auth_is_plain_zmq():
    ctx = zmq.Context()
    auth = PlaneAuth(ctx, None)
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        auth.server(pull, "engine_input")
        auth.client(push)
        assert not auth.enabled and pull.getsockopt(zmq.MECHANISM) == zmq.NULL
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x")
        assert pull.poll(10_000) and pull.recv() == b"x"
    finally:
        pull.close(0)
        push.close(0)
        auth.close()
        ctx.term()
