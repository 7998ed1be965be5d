"""A prefill engine's connector in its own OS process, driven over a pipe.

Used by the two-process tests (and mirrors what the benchmark does): the
child owns a NIXL agent with a KV tensor of known random content (seeded),
hands out kv_transfer_params for "finished prefills" and reports
``done_sending`` events as D's notifications or lease expiries arrive.

    parent -> child  ("finish", request_id, num_prompt_tokens, block_ids)
    child -> parent  ("params", request_id, params_dict)
    child -> parent  ("done_sending", request_id, seconds_since_finish)
    parent -> child  ("stats",) -> ("stats", dict + "wire": wire_stats()) ; ("ping",) -> ("pong",)
    parent -> child  ("block", seconds, how) -> ("blocking",), then the loop
                     stays away from NIXL that long (``block_loop``)
    parent -> child  ("stop",) -> exits
"""

from __future__ import annotations

import time
from typing import Any

from tests import forkserver


def kv_content(shape: tuple[int, ...], seed: int):
    """The deterministic KV tensor a prefill process registers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def block_loop(seconds: float, how: str) -> None:
    """Keep the calling thread busy like a long forward pass: ``python`` (a
    pure-Python loop: holds the GIL, hands it over every 5 ms), ``sleep``
    (a C call that releases the GIL) or ``c_gil`` (a C call that holds the
    GIL throughout, e.g. an extension without a GIL release)."""
    if how == "python":
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
    elif how == "sleep":
        time.sleep(seconds)
    elif how == "c_gil":
        import ctypes

        ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # PyDLL: the GIL stays held
    else:
        raise ValueError(f"unknown block mode {how!r}")


def finish_prefill(scheduler, request_id: str, num_prompt: int, block_ids: list[int]):
    """A prefill engine's scheduler side sees ``request_id`` finish its prefill
    (the prompt computed, one token sampled): ``(kv_transfer_params, the step's
    connector metadata)``."""
    from tandem.scheduler.request import Request, RequestStatus
    from tandem.wire.engine_protocol import SamplingParams

    req = Request(
        request_id,
        list(range(num_prompt)),
        SamplingParams(max_tokens=1),
        kv_transfer_params={"do_remote_decode": True},
    )
    req.num_computed_tokens = num_prompt
    req.append_output_token(1)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = scheduler.request_finished(req, block_ids)
    return params, scheduler.build_connector_meta(None)


def run_prefill(
    conn,
    config_kwargs: dict[str, Any],
    shape: tuple[int, ...],
    seed: int,
    poll_interval_s: float,
    env: dict[str, str] | None = None,
) -> None:
    import os

    os.environ.update(env or {})  # before NIXL reads UCX's settings
    from tandem.kvtransfer import KVTransferConfig, create_connector
    from tandem.scheduler.messages import KVConnectorOutput

    scheduler, worker = create_connector(KVTransferConfig(role="prefill", **config_kwargs))
    kv = kv_content(shape, seed).to(config_kwargs.get("device", "cpu"))  # VRAM with "cuda"
    worker.register_kv_caches(kv)
    conn.send(("ready", worker.side_channel_port))
    finished_at: dict[str, float] = {}
    try:
        while True:
            if conn.poll(poll_interval_s):
                msg = conn.recv()
                if msg[0] == "stop":
                    return
                if msg[0] == "stats":
                    conn.send(("stats", {**worker.stats(), "wire": worker.wire_stats()}))
                    continue
                if msg[0] == "ping":
                    conn.send(("pong",))
                    continue
                if msg[0] == "block":
                    conn.send(("blocking",))
                    block_loop(msg[1], msg[2])
                    continue
                _, request_id, num_prompt, block_ids = msg
                params, meta = finish_prefill(scheduler, request_id, num_prompt, block_ids)
                finished_at[request_id] = time.perf_counter()
                worker.start_load_kv(meta)
                conn.send(("params", request_id, params))
            done_sending, _ = worker.get_finished()
            scheduler.update_connector_output(
                KVConnectorOutput(finished_sending=list(done_sending))
            )
            for request_id in done_sending:
                elapsed = time.perf_counter() - finished_at.pop(request_id)
                conn.send(("done_sending", request_id, elapsed))
    finally:
        worker.shutdown()


class ChildProcess:
    """A child process driven over a pipe (``target(conn, *args)``): every wait
    has a deadline, ``close`` always reaps. Messages are tuples; the ones a
    wait skips are kept for later waits."""

    what = "child process"

    def __init__(self, target, args: tuple) -> None:
        ctx = forkserver.context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.process.start()
        self.events: list[tuple] = []

    def send(self, *msg: Any) -> None:
        self._conn.send(msg)

    def wait(self, match, timeout_s: float = 20.0) -> tuple:
        for i, msg in enumerate(self.events):
            if match(msg):
                return self.events.pop(i)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.process.is_alive() and not self._conn.poll():
                raise RuntimeError(f"{self.what} died (exit code {self.process.exitcode})")
            if self._conn.poll(0.05):
                msg = self._conn.recv()
                if match(msg):
                    return msg
                self.events.append(msg)
        raise TimeoutError(f"no matching message from the {self.what} in {timeout_s} s")

    def close(self) -> None:
        try:
            if self.process.is_alive():
                self._conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()


class PrefillProcess(ChildProcess):
    """Parent-side handle of one prefill connector process."""

    what = "prefill process"

    def __init__(
        self,
        config_kwargs: dict[str, Any],
        shape: tuple[int, ...],
        seed: int,
        poll_interval_s: float = 0.002,
        env: dict[str, str] | None = None,
    ):
        self.engine_id = config_kwargs.get("engine_id", "engine-0")
        self.epoch = config_kwargs.get("epoch", 0)
        super().__init__(run_prefill, (config_kwargs, shape, seed, poll_interval_s, env))
        self.port = self.wait(lambda m: m[0] == "ready", 60.0)[1]

    @property
    def endpoint(self) -> list:
        """What the cluster registers with decode engines for this process."""
        return [self.engine_id, self.epoch, "127.0.0.1", self.port]

    def finish(self, request_id: str, num_prompt: int, block_ids: list[int]) -> dict:
        self._conn.send(("finish", request_id, num_prompt, block_ids))
        return self.wait(lambda m: m[0] == "params" and m[1] == request_id, 10.0)[2]

    def wait_done_sending(self, request_id: str, timeout_s: float = 10.0) -> float:
        return self.wait(lambda m: m[0] == "done_sending" and m[1] == request_id, timeout_s)[2]

    def poll_done_sending(self, request_id: str, timeout_s: float) -> bool:
        try:
            self.wait_done_sending(request_id, timeout_s)
            return True
        except TimeoutError:
            return False

    def ping(self) -> float:
        """Seconds of one pipe round trip (the machine's wake-up latency)."""
        start = time.perf_counter()
        self._conn.send(("ping",))
        self.wait(lambda m: m[0] == "pong", 10.0)
        return time.perf_counter() - start

    def block(self, seconds: float, how: str) -> None:
        """Make the child's loop stay away from NIXL for ``seconds``
        (``block_loop``); returns once the child has started blocking."""
        self._conn.send(("block", seconds, how))
        self.wait(lambda m: m[0] == "blocking", 10.0)

    def stats(self) -> dict:
        self._conn.send(("stats",))
        return self.wait(lambda m: m[0] == "stats", 10.0)[1]
