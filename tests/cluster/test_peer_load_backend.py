"""The in-flight counts of one gateway's backend reach another gateway's
router (``cluster/routing/peer_load.py``), without Ray: RayBackend over two
fake engines on the real ZMQ data plane (``test_migration_backend.py``'s),
sharing through ``ClusterRouting.share_load`` as ``tandem serve`` does in
each of ``--api-server-count``'s gateways; the other gateway is its real
channel and router on the same loop."""

from __future__ import annotations

import asyncio
import tempfile

from tandem.cluster.disagg.migration import MigrationPolicy
from tandem.cluster.routing.peer_load import PeerLoadChannel
from tandem.cluster.routing.policy import RoutingConfig
from tandem.wire.engine_protocol import FinishReason
from tests.cluster.test_migration_backend import (
    PROMPT,
    Client,
    first_engine,
    request,
    with_backend,
)
from tests.unit.test_peer_load import make_router


def test_a_request_in_flight_on_one_gateway_counts_on_the_others():
    async def scenario(backend, engines) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30

        async def until(cond, what: str) -> None:
            while not cond():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.005)

        with tempfile.TemporaryDirectory(prefix="pl-") as share_dir:
            other = PeerLoadChannel(share_dir, 1, make_router())
            other.start()
            try:
                assert backend.routing.share_load(share_dir, 0) is not None
                client = Client(backend, request())
                engine, req = await first_engine(engines)
                eid = engine.engine_id
                st = other.router.engines[eid]
                # sent, no output yet: one request and its whole prompt queued
                await until(lambda: (st.peer_inflight, st.peer_queued_prefill_tokens) == (1, 4),
                            "the other gateway does not see the request")  # fmt: skip
                assert len(PROMPT) == 4 and backend.router.engines[eid].peer_inflight == 0
                await engine.send(req.request_id, [3])  # the first output: prefill done
                await until(lambda: st.peer_queued_prefill_tokens == 0, "queued tokens stay")
                assert st.peer_inflight == 1
                await engine.send(req.request_id, [4, 5], FinishReason.LENGTH)
                await asyncio.wait_for(client.task, 30)
                await until(lambda: st.peer_inflight == 0, "the ended request stays")
            finally:
                other.close()

    asyncio.run(with_backend(MigrationPolicy(), scenario, routing=RoutingConfig()))
