import re

import pytest

from tandem.kvtransfer.params import KVTransferParams

FULL = {
    "do_remote_prefill": True,
    "remote_engine_id": "p0",
    "remote_block_ids": [3, 4, 9],
    "remote_request_id": "req-1",
    "num_tokens": 40,
    "remote_epoch": 2,
    "lease_remaining_s": 59.5,
}


def test_round_trip_exact():
    params = KVTransferParams.from_dict(FULL)
    assert params.remote_block_ids == [3, 4, 9]
    assert params.to_dict() == FULL


def test_defaults_are_omitted():
    assert KVTransferParams(do_remote_decode=True).to_dict() == {"do_remote_decode": True}
    assert KVTransferParams.from_dict({}).to_dict() == {}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"lease_remaining_s": "60"}, "lease_remaining_s"),
        ({"remote_block_ids": [1, "x"]}, "remote_block_ids[1]"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"remote_epoch": -3}, "remote_epoch"),
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_engine_id": ""}, "remote_engine_id"),
        ({"remote_request_id": None}, "remote_request_id"),
        ({"lease_remaining_s": 0}, "lease_remaining_s"),
        ({"lease_remaining_s": -5.0}, "lease_remaining_s"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"do_remote_decode": True}, "do_remote_prefill"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ],
)
def test_bad_field_is_named(patch, field):
    with pytest.raises(ValueError, match=re.escape(f"kv_transfer_params.{field}")):
        KVTransferParams.from_dict({**FULL, **patch})


def test_a_lent_host_prefix_may_come_with_do_remote_decode():
    # a prefill engine borrows a peer's host tier prefix, then hands off to D
    both = {**FULL, "do_remote_decode": True, "remote_medium": "host"}
    assert KVTransferParams.from_dict(both).do_remote_decode
    with pytest.raises(ValueError, match='unless remote_medium is "host"'):
        KVTransferParams.from_dict({**FULL, "do_remote_decode": True})


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="do_remote_prefil"):
        KVTransferParams.from_dict({"do_remote_prefil": True})


def test_not_a_dict():
    with pytest.raises(ValueError, match="must be an object"):
        KVTransferParams.from_dict(["do_remote_decode"])  # type: ignore[arg-type]


def test_an_address_in_params_is_refused():
    """Addresses never travel: D looks the prefill engine up by id + epoch."""
    for field, value in (("remote_host", "203.0.113.9"), ("remote_port", 5555)):
        with pytest.raises(ValueError, match=field):
            KVTransferParams.from_dict({**FULL, field: value})
