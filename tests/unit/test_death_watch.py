"""Fast death evidence (cluster/engines/death_watch.py) against a real
process: a SIGSTOPped peer raises no disconnect (slow is not dead), a killed
one does at once, and /proc tells exited (reaped or zombie) from alive."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import zmq
import zmq.asyncio

from tandem.cluster.engines.actor import free_port
from tandem.cluster.engines.death_watch import DisconnectWatch, confirm_exit, process_gone

PEER = """
import sys, zmq
s = zmq.Context().socket(zmq.PULL)
s.bind(sys.argv[1])
print("bound", flush=True)
while True:  # never exits on its own: only the test's SIGKILL ends it
    s.recv()
"""


def test_process_gone_only_for_exited_processes():
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)  # exited and reaped: no such pid
    assert process_gone(child.pid)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:  # exited, not yet reaped: a zombie is gone too
        assert asyncio.run(confirm_exit(zombie.pid, window_s=30.0))
    finally:
        zombie.wait(30)


def test_disconnect_on_kill_not_on_sigstop():
    async def scenario() -> None:
        addr = f"tcp://127.0.0.1:{free_port()}"
        peer = subprocess.Popen(
            [sys.executable, "-c", PEER, addr], stdout=subprocess.PIPE, text=True
        )
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        seen: asyncio.Queue = asyncio.Queue()
        watch = DisconnectWatch(lambda eid, epoch: seen.put_nowait((eid, epoch)))
        try:
            assert await asyncio.to_thread(peer.stdout.readline) == "bound\n"
            watch.watch("decode-0", 7, sock)
            sock.connect(addr)
            await asyncio.wait_for(sock.send(b"hello"), 30)  # connected
            os.kill(peer.pid, signal.SIGSTOP)  # paused: its kernel keeps the connection
            await asyncio.sleep(1.0)
            assert seen.empty() and not process_gone(peer.pid)
            peer.kill()  # SIGKILL works on a stopped process
            assert await asyncio.wait_for(seen.get(), 30) == ("decode-0", 7)
            assert await confirm_exit(peer.pid, window_s=30.0)
        finally:
            watch.close()
            sock.close(linger=0)
            ctx.term()
            peer.kill()
            peer.wait(30)

    asyncio.run(asyncio.wait_for(scenario(), 90))
