"""Which services may move an engine between the prefill and decode pools
(cluster/engines/pool_moves.py), and what their engines start with."""

from __future__ import annotations

import pytest

from tandem.cluster.cli.settings import serve_config
from tandem.workers.parallel.connector_hook import kv_role


def test_matching_pools_start_every_engine_for_moves():
    config = serve_config(model="tiny", prefill=1, decode=2)
    assert config.pool_moves_off() is None
    for role in ("prefill", "decode"):
        engine = config.pool_engine(role)
        assert engine.kv_transfer.pool_moves and kv_role(engine) == "both", role
        assert engine.runtime.role == role


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"pool_moves": False}, "--no-pool-moves"),
        ({"decode_engine": {"max_num_seqs": 8}}, "max_num_seqs"),
        ({"prefill_engine": {"num_kv_blocks": 64}}, "--prefill-num-kv-blocks"),
        ({"decode_ray_resources": {"tandem_decode": 1}}, "--decode-ray-resources"),
        ({"decode_num_gpus_per_engine": 0.5}, "--decode-num-gpus-per-engine"),
        ({"prefill": 0}, "a prefill and a decode pool"),
    ],
)
def test_pools_that_differ_keep_moves_off_and_say_why(settings, named):
    config = serve_config(**{"model": "tiny", "prefill": 1, "decode": 1, **settings})
    why = config.pool_moves_off()
    assert why is not None and named in why, why
    roles = [r for r in ("prefill", "decode") if config.pools.pool(r).num_engines]
    for role in roles:
        assert not config.pool_engine(role).kv_transfer.pool_moves, role


def test_a_colocated_pool_never_moves():
    config = serve_config(model="tiny", colocated=2)
    assert "colocated" in config.pool_moves_off()
    assert not config.pool_engine("colocated").kv_transfer.pool_moves


def test_a_colocated_tp_pool_with_tiers_builds_no_prefill_engine():
    """Tiers under tensor parallelism are refused beside a NIXL connector, which a
    prefill engine has: a colocated service with them must not build one to decide
    about moves (the service then failed to start)."""
    config = serve_config(
        model="tiny", colocated=1, kv_offloading_size=0.01, tensor_parallel_size=2
    )
    assert "colocated" in config.pool_moves_off()
    engine = config.pool_engine("colocated")
    assert engine.kv_transfer.connector is None and not engine.kv_transfer.pool_moves
