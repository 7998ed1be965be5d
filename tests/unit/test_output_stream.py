"""The data plane's per-request queue (cluster/disagg/data_plane.py ``OutputStream``):
arrival order, a waiting consumer woken by a put, puts that come before any wait,
a consumer cancelled while it waits (the stream cut, a client gone) leaving the
queue usable, and ``get_nowait`` on an empty queue raising as ``asyncio.Queue`` does
(migration drains it that way)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.cluster.disagg.data_plane import OutputStream


def test_items_come_out_in_arrival_order_whether_or_not_the_consumer_waited():
    async def scenario():
        q = OutputStream()
        q.put_nowait(("e", 1))
        q.put_nowait(("e", 2))
        assert q.qsize() == 2 and not q.empty()
        got = [await q.get(), await q.get()]
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing queued: it waits
        q.put_nowait(("e", 3))
        q.put_nowait(("e", 4))  # a second put before the consumer runs
        got.append(await asyncio.wait_for(waiting, 5))
        got.append(await asyncio.wait_for(q.get(), 5))
        assert got == [("e", 1), ("e", 2), ("e", 3), ("e", 4)]
        assert q.empty() and q.qsize() == 0

    asyncio.run(scenario())


def test_a_consumer_cancelled_while_waiting_leaves_the_queue_usable():
    async def scenario():
        q = OutputStream()
        waiting = asyncio.ensure_future(q.get())
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        q.put_nowait(("e", 1))  # no waiter left to wake: kept for the next get
        assert await asyncio.wait_for(q.get(), 5) == ("e", 1)

    asyncio.run(scenario())


def test_get_nowait_takes_what_is_there_and_raises_queue_empty_after():
    async def scenario():
        q = OutputStream()
        q.put_nowait(("e", 1))
        assert q.get_nowait() == ("e", 1)
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()

    asyncio.run(scenario())
