"""Real NIXL between two processes with a cluster secret: a decode engine of
the cluster reads P's blocks byte for byte; one without the secret cannot
handshake, so it never gets P's agent metadata and reads nothing."""

from __future__ import annotations

import pytest
import torch

from tandem.kvtransfer import KVTransferConfig, create_connector
from tandem.wire.auth import generate_secret
from tests.kvtransfer.prefill_process import kv_content
from tests.kvtransfer.test_nixl_connector import (
    COMMON,
    D_SHAPE,
    P_SHAPE,
    as_bytes,
    prefill,
    pull,
)

pytestmark = pytest.mark.slow

SECRET = generate_secret()


def decode_side(secret):
    config = KVTransferConfig(
        role="decode", engine_id="d0", handshake_timeout_s=1.0, cluster_secret=secret, **COMMON
    )
    scheduler, worker = create_connector(config)
    kv = torch.zeros(D_SHAPE)
    worker.register_kv_caches(kv)
    return scheduler, worker, kv


def test_only_cluster_members_read_kv():
    p_kv = kv_content(P_SHAPE, seed=0)
    with prefill(cluster_secret=SECRET) as p:
        for intruder in (None, generate_secret()):
            d = decode_side(intruder)
            try:
                params = p.finish(f"steal-{intruder is None}", 8, [1, 2])
                num_external, errors = pull(d, f"steal-{intruder is None}", params, 8, [5, 6])
                assert errors == {5, 6}  # the load failed: the handshake never completed
                stats = d[1].stats()
                assert stats["num_handshake_failures"] == 1
                assert stats.get("kv_transfer_bytes_total", 0) == 0
                assert not d[2].any()
            finally:
                d[1].shutdown()
        assert p.stats()["wire"]["auth_failures"]["kv_side_channel"] >= 2
        member = decode_side(SECRET)
        try:
            params = p.finish("r1", 8, [3, 4])
            assert pull(member, "r1", params, 8, [7, 9]) == (8, set())
            for local, remote in ((7, 3), (9, 4)):
                assert torch.equal(as_bytes(member[2][local]), as_bytes(p_kv[remote]))
            p.wait_done_sending("r1")
            wire = member[1].wire_stats()
            assert wire == {"malformed_frames": {}, "auth_failures": {}}
        finally:
            member[1].shutdown()
