"""An idle engine loop wakes for the work other threads hand it (``EngineService._wake``):
a control call (``call_in_loop``) and ``shutdown`` are served while the loop waits on its
input, not at its next idle tick. The idle wait is set to ten minutes here, so only the
wake-up can serve them within the tests' deadlines."""

from __future__ import annotations

import threading

import pytest
import zmq

from tandem.cluster.engines.actor import free_port
from tandem.workers.config import EngineConfig
from tandem.workers.engine import loop_wait
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.service import EngineService

pytestmark = pytest.mark.slow  # an engine loop on real sockets


def test_an_idle_loop_serves_control_calls_and_stops_without_waiting_out_its_tick(
    tiny_model_dir, monkeypatch
):
    monkeypatch.setattr(loop_wait, "IDLE_WAIT_MS", 600_000)
    service = EngineService(EngineCore(EngineConfig.from_flat(model=tiny_model_dir)))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    out_addr = f"tcp://127.0.0.1:{free_port()}"
    pull.bind(out_addr)
    thread = threading.Thread(
        target=service.serve_zmq,
        args=(f"tcp://127.0.0.1:{free_port()}", out_addr),
        kwargs={"gateway_session": 1},
        daemon=True,
    )
    thread.start()
    try:
        # the loop's first heartbeat: it runs, and from now on it waits on its input
        assert pull.poll(60_000), "no heartbeat from the engine loop"
        assert pull.recv_multipart()[0] == b"H"
        on_loop = []
        for _ in range(3):  # each call a wake-up of its own
            assert service.call_in_loop(
                lambda: on_loop.append(threading.current_thread() is thread) or True,
                timeout_s=20.0,
            )
        assert on_loop == [True, True, True]
        assert service.call_in_loop(service.engine.check_integrity, timeout_s=20.0)
    finally:
        service.shutdown()
        thread.join(20)
        alive = thread.is_alive()
        pull.close(linger=0)
        ctx.term()
    assert not alive, "shutdown did not wake the idle loop"
    assert service._wake_fds is None  # the pipe is closed with the loop
