"""CURVE authentication of the internal planes from one per-cluster secret.

Every engine, the gateway and the prefill side channels share one secret
(``tandem serve`` generates 32 random bytes, or reads
``--cluster-secret-file``, and hands it to engines in their actor's
constructor arguments). Two CURVE keypairs are derived from it with
HMAC-SHA256: a *server* pair every bound socket uses, a *client* pair every
connecting socket uses. So:

* a client must know the server's public key to complete the handshake at
  all (it is never sent on the wire), and
* the server's ZAP handler admits only the client public key derived from
  the secret; CURVE proves the client holds the matching secret key.

A peer without the secret never completes a handshake: nothing it sends is
delivered to the application and nothing is sent back to it. Traffic after
the handshake is encrypted and authenticated by CURVE.

``PlaneAuth`` configures the sockets of one ``zmq.Context`` and runs one
daemon thread for it: the ZAP handler (``inproc://zeromq.zap.01``) and the
monitors of its server sockets, which count refused handshakes per socket
name (``HANDSHAKE_FAILED_*`` events: wrong keys, no CURVE at all, denied by
ZAP). With ``secret=None`` it does nothing: plain ZMQ, the documented
development mode for in-process engines and tests.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
_LOG_INTERVAL_S = 1.0
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_ids = itertools.count()


def generate_secret() -> bytes:
    """32 random bytes: the secret of a new cluster."""
    return secrets.token_bytes(32)


def read_secret_file(path: str) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped). Raises
    ``ValueError`` naming the file when it is shorter than 16 bytes."""
    with open(path, "rb") as f:
        value = f.read().strip()
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(
            f"--cluster-secret-file {path}: the secret must be at least {MIN_SECRET_BYTES} "
            f"bytes, got {len(value)}"
        )
    return value


def check_secret(secret: bytes | None, field: str = "cluster_secret") -> None:
    """``ValueError`` naming ``field`` unless ``secret`` is None or long enough bytes."""
    if secret is None:
        return
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{field} must be None or at least {MIN_SECRET_BYTES} bytes")


def secret_fingerprint(secret: bytes | None) -> str | None:
    """A short public tag of ``secret`` (HMAC-derived like the keys, so it
    reveals nothing about it): a gateway adopting running engines checks that
    it holds their secret before connecting. None without a secret."""
    if secret is None:
        return None
    return hmac.new(secret, b"tandem/fingerprint/v1", hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """Z85-encoded CURVE keys derived from a cluster secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, secret: bytes) -> CurveKeys:
        check_secret(secret)
        pairs = []
        for label in (b"tandem/curve/server/v1", b"tandem/curve/client/v1"):
            secret_key = z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
            pairs.append((zmq.curve_public(secret_key), secret_key))
        (sp, ss), (cp, cs) = pairs
        return cls(sp, ss, cp, cs)

    def __repr__(self) -> str:
        return "CurveKeys(<derived from the cluster secret>)"


def curve_available() -> bool:
    return bool(zmq.has("curve"))


class PlaneAuth:
    """CURVE for the sockets of one context. Call ``server`` on a socket
    before it binds and ``client`` before it connects, from the thread that
    owns the socket. ``failures()`` is safe from any thread."""

    def __init__(self, context: zmq.Context, secret: bytes | None) -> None:
        self.enabled = secret is not None
        self._context = context
        self._keys = CurveKeys.derive(secret) if secret is not None else None
        self._failures: dict[str, int] = {}
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._control = f"inproc://tandem-auth-control-{os.getpid()}-{next(_ids)}"
        self._pending: queue.Queue[tuple[str, str, threading.Event]] = queue.Queue()
        if self.enabled and not curve_available():
            raise RuntimeError("this pyzmq's libzmq has no CURVE support (zmq.has('curve'))")

    @property
    def keys(self) -> CurveKeys | None:
        return self._keys

    def server(self, sock: zmq.Socket, name: str) -> None:
        """Make ``sock`` a CURVE server that admits only cluster clients;
        refused handshakes are counted under ``name``."""
        if self._keys is None:
            return
        self._start()
        sock.setsockopt(zmq.ZAP_DOMAIN, name.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.server_secret)
        endpoint = f"inproc://tandem-monitor-{os.getpid()}-{next(_ids)}"
        sock.monitor(endpoint, _FAILED_EVENTS)
        added = threading.Event()
        self._pending.put((endpoint, name, added))
        self._poke(b"add")
        if not added.wait(10.0):
            raise RuntimeError(f"auth thread did not take the monitor of {name}")

    def client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client holding the cluster's client key."""
        if self._keys is None:
            return
        sock.setsockopt(zmq.CURVE_SERVERKEY, self._keys.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.client_secret)

    def failures(self) -> dict[str, int]:
        """Refused handshakes per socket name since start."""
        with self._lock:
            return dict(self._failures)

    def close(self) -> None:
        """Stop the thread (before the context is terminated). Idempotent."""
        if self._thread is None:
            return
        self._poke(b"stop")
        self._thread.join(5.0)
        self._thread = None

    # ---- the auth thread -----------------------------------------------------

    def _poke(self, message: bytes) -> None:
        sock = zmq.Context.shadow(self._context.underlying).socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.connect(self._control)
            sock.send(message)
        finally:
            sock.close()

    def _start(self) -> None:
        if self._thread is not None:
            return
        ready = threading.Event()
        errors: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, errors), name="tandem-zap", daemon=True
        )
        self._thread.start()
        if not ready.wait(10.0) or errors:
            raise RuntimeError(f"ZAP handler did not start: {errors}")

    def _run(self, ready: threading.Event, errors: list[BaseException]) -> None:
        ctx = zmq.Context.shadow(self._context.underlying)
        try:
            zap = ctx.socket(zmq.REP)
            zap.setsockopt(zmq.LINGER, 0)
            zap.bind(ZAP_ENDPOINT)
            control = ctx.socket(zmq.PAIR)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(self._control)
        except zmq.ZMQError as e:
            errors.append(e)
            ready.set()
            return
        ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is zap:
                        zap.send_multipart(self._zap_reply(zap.recv_multipart()))
                    elif sock is control:
                        if control.recv() == b"stop":
                            return
                        while not self._pending.empty():
                            endpoint, name, added = self._pending.get()
                            mon = ctx.socket(zmq.PAIR)
                            mon.setsockopt(zmq.LINGER, 0)
                            mon.connect(endpoint)
                            monitors[mon] = name
                            poller.register(mon, zmq.POLLIN)
                            added.set()
                    else:
                        self._on_event(sock, monitors)
        finally:
            for mon in monitors:
                mon.close()
            zap.close()
            control.close()

    def _on_event(self, mon: zmq.Socket, monitors: dict[zmq.Socket, str]) -> None:
        try:
            event = recv_monitor_message(mon)
        except (zmq.ZMQError, ValueError):
            return
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # the socket closed
            mon.close()
            monitors.pop(mon, None)
            return
        if not event["event"] & _FAILED_EVENTS:
            return
        name = monitors.get(mon, "unknown")
        with self._lock:
            self._failures[name] = self._failures.get(name, 0) + 1
        if not self._should_log(name):
            return
        logger.warning(
            "refused a peer on %s (%s, code %s)",
            name,
            zmq.Event(event["event"]).name,
            event["value"],
        )

    def _should_log(self, key: str) -> bool:
        """Refused clients retry every 100 ms: at most one line a second per key."""
        now = time.monotonic()
        if now - self._last_log.get(key, -1e9) < _LOG_INTERVAL_S:
            return False
        self._last_log[key] = now
        return True

    def _zap_reply(self, frames: list[bytes]) -> list[bytes]:
        """ZAP 1.0: ``[version, id, domain, address, identity, mechanism,
        credentials...]`` -> ``[version, id, status, text, user id, metadata]``."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad request", b"", b""]
        version, request_id, domain, address, _, mechanism = frames[:6]
        assert self._keys is not None
        expected = z85.decode(self._keys.client_public)
        if mechanism == b"CURVE" and len(frames) == 7 and frames[6] == expected:
            return [version, request_id, b"200", b"OK", b"tandem-cluster", b""]
        if not self._should_log("zap:" + domain.decode(errors="replace")):
            return [version, request_id, b"400", b"not a cluster member", b"", b""]
        logger.warning(
            "denied %s on %s: not the cluster's client key (mechanism %s)",
            address.decode(errors="replace"),
            domain.decode(errors="replace"),
            mechanism.decode(errors="replace"),
        )
        return [version, request_id, b"400", b"not a cluster member", b"", b""]
