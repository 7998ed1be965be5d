"""ZMQ side channel of a prefill engine: handshakes and notifications.

::

    D handshake thread  REQ ----HandshakeRequest----> ROUTER  P side-channel thread
                            <---HandshakeResponse----         agent metadata, engine id,
                                                              epoch, compat hash + layout,
                                                              KV region (encoded once)
    D loop thread    DEALER ----Notification--------> ROUTER  -> queue -> P worker
                            ("done" / "renew" + P's request id; one way)

Why notifications travel here and not as NIXL notifications: measured with
UCX and no progress thread (nixl 1.5.1), a READ posted after a NIXL
notification to the same peer waits until the peer's loop next progresses
UCX (a whole prefill forward, on a busy P). Kept off NIXL, READs stay
one-sided and P's side-channel thread receives notifications at once.

The server makes no NIXL call. Every client wait has a deadline; sending a
notification never blocks (ZMQ queues it).

Hardening (``wire/``): with a cluster secret the ROUTER is a CURVE server and
D's sockets CURVE clients, so a peer without the secret never completes a
handshake and never learns P's agent metadata or KV region. Every message
either side receives is checked (frame count, size cap, msgpack of the
expected type); a malformed one is dropped and counted under
``kv_side_channel`` (P) or ``kv_handshake_reply`` (D), and the thread keeps
serving.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgspec
import zmq

from tandem.kvtransfer.compat import CONNECTOR_VERSION, KVLayout, RankLayout
from tandem.kvtransfer.nixl_meta import NotifKey
from tandem.wire.auth import PlaneAuth
from tandem.wire.frames import (
    HARD_LIMIT_FACTOR,
    FrameCounters,
    MalformedFrame,
    MiB,
    check_size,
    decode,
    frame_bytes,
    peer_address,
)

logger = logging.getLogger(__name__)

_POLL_MS = 100
_MAX_NOTIFY_SOCKETS = 256
# Handshake requests and notifications are tens of bytes; a reply carries
# NIXL agent metadata (kilobytes).
MAX_REQUEST_BYTES = 1 * MiB
MAX_REPLY_BYTES = 16 * MiB
SERVER_SOCKET = "kv_side_channel"
REPLY_SOCKET = "kv_handshake_reply"


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """The registered KV tensor of one engine: block ``i`` of every layer is
    the ``block_len`` bytes at ``base_addr + i * block_len``."""

    base_addr: int
    block_len: int
    num_blocks: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


class HandshakeInfo(msgspec.Struct, array_like=True):
    """What one worker rank publishes: its agent, the engine's hashed layout,
    and its own shard (``rank``: TP size, rank, heads held) and region."""

    engine_id: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    compat_hash: str
    layout: KVLayout
    region: RegionInfo
    rank: RankLayout = RankLayout()
    # the engine's host KV tier (kvtransfer/tiers/), registered with the same agent:
    # slot i is the block_len bytes at base_addr + i * block_len; None without one
    host_region: RegionInfo | None = None


class HandshakeRequest(msgspec.Struct, array_like=True, tag="handshake"):
    connector_version: int
    requester_engine_id: str


class Notification(msgspec.Struct, array_like=True, tag="notify"):
    """``kind`` ("done" / "renew") about P's ``request_id``; addressed to one
    incarnation (engine id + epoch) so a restarted P ignores stale ones.
    ``rank`` / ``num_ranks``: which decode rank says it (``nixl_meta.NotifKey``)."""

    engine_id: str
    epoch: int
    kind: str
    request_id: str
    rank: int = 0
    num_ranks: int = 1


class HandshakeResponse(msgspec.Struct, array_like=True, omit_defaults=True):
    connector_version: int
    info: HandshakeInfo | None = None
    error: str = ""


class HandshakeError(RuntimeError):
    """The peer could not be reached, refused, or is incompatible."""


_REQUEST_DECODER = msgspec.msgpack.Decoder(HandshakeRequest | Notification)
_REPLY_DECODER = msgspec.msgpack.Decoder(HandshakeResponse)


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """A ROUTER socket on a daemon thread. ``port`` is known once constructed."""

    def __init__(
        self,
        engine_id: str,
        epoch: int,
        host: str,
        port: int,
        *,
        secret: bytes | None = None,
        start_timeout_s: float = 5.0,
    ):
        self.engine_id = engine_id
        self.epoch = epoch
        self._context = zmq.Context()
        self.auth = PlaneAuth(self._context, secret)
        self.malformed_frames = FrameCounters()
        self._reply: bytes = msgspec.msgpack.encode(
            HandshakeResponse(
                CONNECTOR_VERSION, error=f"engine {engine_id}: KV cache not registered"
            )
        )
        # appended by the server thread, drained by the worker
        self._notifications: collections.deque[NotifKey] = collections.deque()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self.port = 0
        self.num_handshakes_served = 0
        self._thread = threading.Thread(
            target=self._serve, args=(host, port), name=f"kv-side-channel-{engine_id}", daemon=True
        )
        self._thread.start()
        if not self._bound.wait(start_timeout_s):
            self.close()
            raise HandshakeError(f"side channel of {engine_id} did not bind in {start_timeout_s} s")
        if self._bind_error is not None:
            self.close()
            raise HandshakeError(f"side channel bind {host}:{port} failed: {self._bind_error}")

    def set_info(self, info: HandshakeInfo) -> None:
        """Serve ``info`` from now on (called once the KV cache is registered)."""
        self._reply = msgspec.msgpack.encode(HandshakeResponse(CONNECTOR_VERSION, info=info))

    def drain_notifications(self) -> list[NotifKey]:
        """Notifications received since the last call, in order."""
        out = []
        while self._notifications:
            out.append(self._notifications.popleft())
        return out

    def _serve(self, host: str, port: int) -> None:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES * HARD_LIMIT_FACTOR)
        try:
            self.auth.server(sock, SERVER_SOCKET)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if port == 0:
                self.port = sock.bind_to_random_port(_endpoint(host, 0).rsplit(":", 1)[0])
            else:
                sock.bind(_endpoint(host, port))
                self.port = port
        except (zmq.ZMQError, RuntimeError) as e:
            self._bind_error = e
            sock.close()
            self._bound.set()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    reply = self._handle(frames)
                    if reply is not None:  # [identity, b"", payload] for a REQ client
                        sock.send_multipart([frames[0], b"", reply])
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.error("side channel of %s stopped: %s", self.engine_id, e)
        finally:
            sock.close()

    def _handle(self, frames: list) -> bytes | None:
        """``[identity, b"", payload]`` from a REQ or DEALER peer. A malformed
        message is counted; if it is REQ-shaped it gets an error reply (so a
        REQ client fails at once instead of at its deadline)."""
        if len(frames) != 3 or len(frames[1]) != 0:
            self.malformed_frames.record(
                SERVER_SOCKET,
                peer_address(frames),
                f"expected [identity, empty, payload], got {len(frames)} frames",
            )
            return None
        try:
            check_size(frames[2], MAX_REQUEST_BYTES)
            message = decode(_REQUEST_DECODER, frame_bytes(frames[2]))
        except MalformedFrame as e:
            self.malformed_frames.record(SERVER_SOCKET, peer_address(frames), e)
            return msgspec.msgpack.encode(
                HandshakeResponse(CONNECTOR_VERSION, error=f"malformed side-channel message: {e}")
            )
        if isinstance(message, Notification):
            if not 0 <= message.rank < message.num_ranks:
                self.malformed_frames.record(
                    SERVER_SOCKET,
                    peer_address(frames),
                    f"notification rank {message.rank} of {message.num_ranks}",
                )
            elif message.engine_id == self.engine_id and message.epoch == self.epoch:
                self._notifications.append(
                    NotifKey(message.kind, message.request_id, message.rank, message.num_ranks)
                )
            return None
        if message.connector_version != CONNECTOR_VERSION:
            error = f"connector version {message.connector_version} != {CONNECTOR_VERSION}"
            return msgspec.msgpack.encode(HandshakeResponse(CONNECTOR_VERSION, error=error))
        self.num_handshakes_served += 1
        return self._reply

    def close(self) -> None:
        """Stop the thread and free the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000 + 1.0)
        if self._thread.is_alive():  # never block shutdown on a stuck thread
            logger.warning("side channel thread of %s did not stop", self.engine_id)
            return
        self.auth.close()
        self._context.term()


def fetch_handshake(
    context: zmq.Context,
    host: str,
    port: int,
    requester_engine_id: str,
    timeout_s: float,
    *,
    auth: PlaneAuth | None = None,
    malformed: FrameCounters | None = None,
) -> HandshakeInfo:
    """One request/reply with the peer's side channel. Raises ``HandshakeError``
    on timeout, a malformed reply (counted in ``malformed``) or a refusal.
    With ``auth`` the socket is a CURVE client: a peer that is not a cluster
    member never answers (timeout). Safe to call from any thread (the socket
    is private to the call).

    ``timeout_s`` bounds the send too: a peer that refuses the CURVE handshake
    before the request is queued ends the connection for good (a protocol error:
    no reconnect), and a REQ socket with no connection waits forever to send."""
    deadline_s = time.monotonic() + timeout_s
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES * HARD_LIMIT_FACTOR)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    if auth is not None:
        auth.client(sock)
    try:
        sock.connect(_endpoint(host, port))
        no_reply = f"no handshake reply from {host}:{port} within {timeout_s} s"
        try:
            sock.send(
                msgspec.msgpack.encode(HandshakeRequest(CONNECTOR_VERSION, requester_engine_id))
            )
        except zmq.Again:
            raise HandshakeError(f"{no_reply} (no connection took the request)") from None
        left_ms = max(0, int((deadline_s - time.monotonic()) * 1000))
        if not sock.poll(left_ms, zmq.POLLIN):
            raise HandshakeError(no_reply)
        frames = sock.recv_multipart(copy=False)
    finally:
        sock.close()
    try:
        if len(frames) != 1:
            raise MalformedFrame(f"expected 1 frame, got {len(frames)}")
        check_size(frames[0], MAX_REPLY_BYTES)
        response = decode(_REPLY_DECODER, frame_bytes(frames[0]))
    except MalformedFrame as e:
        if malformed is not None:
            malformed.record(REPLY_SOCKET, f"{host}:{port}", e)
        raise HandshakeError(
            f"malformed handshake reply from {host}:{port} (connector version mismatch?): {e}"
        ) from None
    if response.info is None:
        raise HandshakeError(f"peer {host}:{port} refused handshake: {response.error}")
    return response.info


class NotificationSender:
    """One DEALER per peer endpoint; for the loop thread only. ``send`` never
    blocks: ZMQ queues messages until the connection is up (or drops them at
    the high-water mark, which counts as a failure)."""

    def __init__(self, context: zmq.Context, auth: PlaneAuth | None = None) -> None:
        self._context = context
        self._auth = auth
        self._sockets: collections.OrderedDict[tuple[str, int], zmq.Socket] = (
            collections.OrderedDict()
        )

    def send(self, host: str, port: int, notification: Notification) -> bool:
        key = (host, port)
        sock = self._sockets.get(key)
        if sock is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if self._auth is not None:
                self._auth.client(sock)
            sock.connect(_endpoint(host, port))
            self._sockets[key] = sock
            if len(self._sockets) > _MAX_NOTIFY_SOCKETS:
                self._sockets.popitem(last=False)[1].close()
        else:
            self._sockets.move_to_end(key)
        try:
            sock.send_multipart([b"", msgspec.msgpack.encode(notification)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
