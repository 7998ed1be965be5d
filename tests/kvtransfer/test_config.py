import dataclasses

import pytest

from tandem.kvtransfer.compat import KVLayout, compat_hash, describe_mismatch
from tandem.kvtransfer.config import KVTransferConfig


def test_defaults_valid():
    config = KVTransferConfig()
    assert config.lease_s == 60.0 and config.load_timeout_s == 30.0
    assert config.handshake_timeout_s == 5.0 and config.load_failure_policy == "recompute"
    assert config.serves_kv and config.pulls_kv


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "router"}, "role"),
        ({"engine_id": ""}, "engine_id"),
        ({"engine_id": "a b"}, "engine_id"),
        ({"epoch": -1}, "epoch"),
        ({"side_channel_port": 70000}, "side_channel_port"),
        ({"lease_s": 0}, "lease_s"),
        ({"load_timeout_s": -1.0}, "load_timeout_s"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s"),
        ({"load_failure_policy": "retry"}, "load_failure_policy"),
        ({"block_size": 0}, "block_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"backends": ()}, "backends"),
    ],
)
def test_invalid_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"KVTransferConfig\.{field}"):
        KVTransferConfig(**kwargs)


def test_roles():
    assert not KVTransferConfig(role="decode").serves_kv
    assert not KVTransferConfig(role="prefill").pulls_kv


def test_advertise_host():
    assert KVTransferConfig(side_channel_host="10.1.2.3").resolved_advertise_host() == "10.1.2.3"
    config = KVTransferConfig(side_channel_host="0.0.0.0", advertise_host="p0.svc")
    assert config.resolved_advertise_host() == "p0.svc"
    assert KVTransferConfig(side_channel_host="0.0.0.0").resolved_advertise_host() != "0.0.0.0"


BASE = KVLayout("tiny", "float32", 4, 2, 16, 16)


def test_compat_hash_stable_and_sensitive_to_every_field():
    assert compat_hash(BASE) == compat_hash(KVLayout("tiny", "float32", 4, 2, 16, 16))
    changes = {
        "model_name": "llama",
        "dtype": "bfloat16",
        "num_layers": 5,
        "num_kv_heads": 4,
        "head_dim": 8,
        "block_size": 32,
        "layout": "layers_first",
        "connector_version": 999,
    }
    assert set(changes) == set(KVLayout.__struct_fields__)
    hashes = {compat_hash(BASE)}
    for name, value in changes.items():
        other = KVLayout(**{**{f: getattr(BASE, f) for f in BASE.__struct_fields__}, name: value})
        hashes.add(compat_hash(other))
        assert describe_mismatch(BASE, other).startswith(f"{name}: local=")
    assert len(hashes) == len(changes) + 1


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVTransferConfig().epoch = 3  # type: ignore[misc]


def test_registry_rejects_unknown_connector():
    from tandem.kvtransfer import available_connectors, create_connector

    assert "nixl" in available_connectors()
    with pytest.raises(ValueError, match=r"unknown KV connector 'nope'.*nixl"):
        create_connector(KVTransferConfig(connector="nope"))


def test_notification_transport_validated():
    with pytest.raises(ValueError, match="KVTransferConfig.notification_transport"):
        KVTransferConfig(notification_transport="carrier-pigeon")
