"""A ``tandem serve`` gateway in its own process, joining the test's Ray, so
a test can crash it (SIGKILL) or stop it (SIGINT) and start another."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tandem.cluster.engines.actor import free_port


class GatewayProcess:
    """``python -m tandem.cluster serve ARGS --port <free>``; output to ``log_path``."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cluster", "serve", *args, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self, deadline_s: float) -> dict:
        """Until /health answers 200; returns its body. Fails (with the log)
        if the process exits or at the deadline."""
        end = time.monotonic() + deadline_s
        while True:
            assert self.proc.poll() is None, f"gateway exited {self.proc.returncode}:\n{self.log()}"
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, f"gateway not healthy in {deadline_s} s:\n{self.log()}"
            time.sleep(0.25)

    def mapped_torch_libraries(self) -> list[str]:
        """Shared objects of torch mapped into the gateway process (``/proc/PID/maps``):
        none, since the serve command bars torch (``cluster/gateway/torch_free.py``)."""
        with open(f"/proc/{self.proc.pid}/maps") as f:
            return sorted({line.split()[-1] for line in f if "libtorch" in line})

    def crash(self) -> None:
        """SIGKILL: nothing of the gateway runs its clean-up."""
        self.proc.kill()
        self.wait(30)

    def stop(self, deadline_s: float = 60.0) -> int:
        """SIGINT (Ctrl-C: the normal shutdown); SIGKILL past the deadline.
        Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.wait(deadline_s)

    def wait(self, deadline_s: float) -> int:
        try:
            self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def gateway_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env
