"""ZMQ side channel: how a decode engine learns to talk to a prefill engine.

::

    D (handshake thread)                 P (side-channel thread)
    REQ --HandshakeRequest-------------> REP
        <--HandshakeResponse------------     agent metadata, engine id, epoch,
                                             compat hash + layout, KV region
    D: check compat, add_remote_agent(metadata), cache per (engine id, epoch)

The server answers from a reply encoded once after the KV cache is
registered; it makes no NIXL call. Every client wait has a deadline.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from kvtransfer.compat import CONNECTOR_VERSION, KVLayout

logger = logging.getLogger(__name__)

_POLL_MS = 100


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """The registered KV tensor of one engine: block ``i`` of every layer is
    the ``block_len`` bytes at ``base_addr + i * block_len``."""

    base_addr: int
    block_len: int
    num_blocks: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


class HandshakeInfo(msgspec.Struct, array_like=True):
    engine_id: str
    epoch: int
    agent_name: str
    agent_metadata: bytes
    compat_hash: str
    layout: KVLayout
    region: RegionInfo


class HandshakeRequest(msgspec.Struct, array_like=True):
    connector_version: int
    requester_engine_id: str


class HandshakeResponse(msgspec.Struct, array_like=True, omit_defaults=True):
    connector_version: int
    info: HandshakeInfo | None = None
    error: str = ""


class HandshakeError(RuntimeError):
    """The peer could not be reached, refused, or is incompatible."""


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class SideChannelServer:
    """A REP socket on a daemon thread. ``port`` is known once constructed."""

    def __init__(self, engine_id: str, host: str, port: int, *, start_timeout_s: float = 5.0):
        self.engine_id = engine_id
        self._context = zmq.Context()
        self._reply: bytes = msgspec.msgpack.encode(
            HandshakeResponse(
                CONNECTOR_VERSION, error=f"engine {engine_id}: KV cache not registered"
            )
        )
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

    def _serve(self, host: str, port: int) -> None:
        sock = self._context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            if port == 0:
                self.port = sock.bind_to_random_port(_endpoint(host, 0).rsplit(":", 1)[0])
            else:
                sock.bind(_endpoint(host, port))
                self.port = port
        except zmq.ZMQError as e:
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
                raw = sock.recv()
                sock.send(self._answer(raw))
        except zmq.ZMQError as e:  # context terminated while closing
            if not self._stop.is_set():
                logger.error("side channel of %s stopped: %s", self.engine_id, e)
        finally:
            sock.close()

    def _answer(self, raw: bytes) -> bytes:
        try:
            request = msgspec.msgpack.decode(raw, type=HandshakeRequest)
        except msgspec.DecodeError:
            return msgspec.msgpack.encode(
                HandshakeResponse(CONNECTOR_VERSION, error="undecodable handshake request")
            )
        if request.connector_version != CONNECTOR_VERSION:
            return msgspec.msgpack.encode(
                HandshakeResponse(
                    CONNECTOR_VERSION,
                    error=f"connector version {request.connector_version} != {CONNECTOR_VERSION}",
                )
            )
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
        self._context.term()


def fetch_handshake(
    context: zmq.Context, host: str, port: int, requester_engine_id: str, timeout_s: float
) -> HandshakeInfo:
    """One request/reply with the peer's side channel. Raises ``HandshakeError``
    on timeout, an undecodable reply or a refusal. Safe to call from any thread
    (the socket is private to the call)."""
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(_endpoint(host, port))
        sock.send(msgspec.msgpack.encode(HandshakeRequest(CONNECTOR_VERSION, requester_engine_id)))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise HandshakeError(f"no handshake reply from {host}:{port} within {timeout_s} s")
        raw = sock.recv()
    finally:
        sock.close()
    try:
        response = msgspec.msgpack.decode(raw, type=HandshakeResponse)
    except msgspec.DecodeError as e:
        raise HandshakeError(
            f"undecodable handshake reply from {host}:{port} (connector version mismatch?): {e}"
        ) from None
    if response.info is None:
        raise HandshakeError(f"peer {host}:{port} refused handshake: {response.error}")
    return response.info
