"""``tandem serve --api-server-count N``: N gateway processes on one port over
one engine fleet.

    tandem serve --api-server-count 3 (this process: Ray driver, owns the engines, serves no HTTP)
      start_pools(no gateway yet)  ->  prefill-0, decode-0 ... (named actors, --ray-namespace)
      gateway 0..N-1: `tandem serve ... --attach --address <gcs> --cluster-secret-file <f>`
                       each binds --host:--port with SO_REUSEPORT, joins every engine
                       (cluster/engines/attach.py), serves its own streams
      a gateway that exits unexpectedly is started again (a new session that joins;
      the engines drop the old one with its requests: workers/engine/gateway_outputs.py)

SO_REUSEPORT rather than one listening socket shared by the children: the
kernel spreads new connections evenly over the N sockets by the connection's
hash, where N processes calling ``accept`` on one shared socket wake
together and the one that wins most often takes most connections (epoll
gives no fairness across processes). Each gateway binds on its own, so a
restarted one needs nothing from this process but its arguments. The cost:
connections still in a dying gateway's accept queue are reset with it
(the client retries), and it is Linux (and BSD) only.

This process holds the engines (their owner in Ray), so a gateway that dies
takes only its own streams; Ctrl-C (SIGINT/SIGTERM) stops the gateways, then
the engines (unless ``--detach-engines``), then the Ray this command started.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

logger = logging.getLogger("tandem.gateways")

# set in each gateway process: its index (bind with SO_REUSEPORT, print one line)
GATEWAY_INDEX_ENV = "TANDEM_GATEWAY_INDEX"
RESTART_BACKOFF_S = (0.5, 5.0)


def gateway_index() -> int | None:
    value = os.environ.get(GATEWAY_INDEX_ENV)
    return int(value) if value not in (None, "") else None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (several gateway
    processes listen on one port; the kernel spreads connections)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--api-server-count > 1 needs SO_REUSEPORT (Linux or BSD)")
    # IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted sockets
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def gateway_argv(argv: list[str], address: str, secret_file: str | None) -> list[str]:
    """The command line of one gateway: this command's, joining the engines
    this process started (later flags win over earlier ones)."""
    args = [a for a in argv if a != "--detach-engines"]  # this process started them
    args += ["--api-server-count", "1", "--attach"]
    args += ["--address", address]
    if secret_file:
        args += ["--cluster-secret-file", secret_file]
    return [sys.executable, "-m", "tandem.cluster", *args]


class GatewaySupervisor:
    """Starts N gateway processes and starts again the ones that exit."""

    def __init__(self, argv: list[str], count: int, env: dict[str, str]) -> None:
        self.argv = argv
        self.count = count
        self.env = env
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.num_restarts = [0] * count
        self._next_start_s = [0.0] * count
        self.stopping = False

    def start(self, i: int) -> None:
        env = {**self.env, GATEWAY_INDEX_ENV: str(i)}
        self.procs[i] = subprocess.Popen(self.argv, env=env)
        logger.info("gateway %d started (pid %d)", i, self.procs[i].pid)
        print(f"tandem: gateway {i} started (pid {self.procs[i].pid})", flush=True)

    def start_all(self) -> None:
        for i in range(self.count):
            self.start(i)

    def watch(self, poll_s: float = 0.2) -> None:
        """Until ``stopping``: a gateway that exited is started again after a
        backoff (doubling from 0.5 s up to 5 s for one that keeps failing)."""
        while not self.stopping:
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None or self.stopping:
                    continue
                now = time.monotonic()
                if self._next_start_s[i] == 0.0:
                    self.num_restarts[i] += 1
                    first, cap = RESTART_BACKOFF_S
                    delay_s = min(first * 2 ** (self.num_restarts[i] - 1), cap)
                    self._next_start_s[i] = now + delay_s
                    logger.warning(
                        "gateway %d (pid %d) exited with %s; starting it again in %.1f s",
                        i,
                        proc.pid,
                        proc.returncode,
                        delay_s,
                    )
                elif now >= self._next_start_s[i]:
                    self._next_start_s[i] = 0.0
                    self.start(i)
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.stopping = True
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)  # uvicorn's graceful shutdown; the gateway leaves
        deadline = time.monotonic() + timeout_s
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def serve_gateways(config: Any, argv: list[str]) -> int:
    """Start Ray (or join ``--address``) and the engine pools, then
    ``--api-server-count`` gateway processes; returns at SIGINT/SIGTERM."""
    import ray

    from tandem.cluster.cli.settings import cluster_secret, pool_specs
    from tandem.cluster.engines.pools import start_pools, stop_pools
    from tandem.cluster.observability.gateway_peers import SHARE_DIR_ENV

    started_ray = False
    if config.ray.address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=config.ray.address or None, log_to_driver=False)
    else:
        ray.init(include_dashboard=config.ray.ray_dashboard, dashboard_host="127.0.0.1")
        started_ray = True
    address = ray.get_runtime_context().gcs_address
    secret = cluster_secret(config)
    secret_file = config.security.cluster_secret_file
    tmp_dir = tempfile.mkdtemp(prefix="tandem-gw-")
    share_dir = os.path.join(tmp_dir, "figures")  # gateway_peers.py: cluster-wide figures
    os.mkdir(share_dir, 0o700)
    own_secret_file = None
    if secret is not None and not secret_file:  # the gateways must hold the engines' secret
        # as text: read_secret_file strips whitespace, which raw bytes may end with
        secret = secret.hex().encode()
        secret_file = own_secret_file = os.path.join(tmp_dir, "cluster-secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
    handles = []
    supervisor = GatewaySupervisor(
        gateway_argv(argv, address, secret_file),
        config.server.api_server_count,
        {**os.environ, SHARE_DIR_ENV: share_dir},
    )

    def on_signal(signum: int, frame: Any) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        handles = start_pools(
            pool_specs(config, secret),
            "",  # no gateway yet: each gateway joins
            namespace=config.ray.ray_namespace,
            gateway_session=0,
            detached=config.ray.detach_engines,
        )
        supervisor.start_all()
        base = f"http://{config.server.host}:{config.server.port}"
        pools = ", ".join(f"{n} {r}" for r, n in config.pools.sizes().items() if n)
        print(
            f"tandem: serving {config.model!r} with {pools} behind "
            f"{config.server.api_server_count} gateways at {base}/v1",
            flush=True,
        )
        supervisor.watch()
    finally:
        supervisor.stop()
        if handles and not config.ray.detach_engines:
            stop_pools(handles)
        if own_secret_file is not None and config.ray.detach_engines:
            print(f"tandem: the engines' secret stays in {own_secret_file}", flush=True)
        else:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        if started_ray:
            ray.shutdown()
        print("tandem: stopped", flush=True)
    return 0
