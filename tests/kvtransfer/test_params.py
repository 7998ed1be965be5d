import re

import pytest

from kvtransfer.params import KVTransferParams

FULL = {
    "do_remote_prefill": True,
    "remote_engine_id": "p0",
    "remote_host": "10.0.0.1",
    "remote_port": 5555,
    "remote_block_ids": [3, 4, 9],
    "remote_request_id": "req-1",
    "num_tokens": 40,
    "remote_epoch": 2,
    "lease_deadline": 1700000000.5,
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
        ({"remote_port": "5555"}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"remote_block_ids": [1, "x"]}, "remote_block_ids[1]"),
        ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"num_tokens": -1}, "num_tokens"),
        ({"remote_epoch": -3}, "remote_epoch"),
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_host": ""}, "remote_host"),
        ({"remote_request_id": None}, "remote_request_id"),
        ({"lease_deadline": 0}, "lease_deadline"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"do_remote_decode": True}, "do_remote_prefill"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ],
)
def test_bad_field_is_named(patch, field):
    with pytest.raises(ValueError, match=re.escape(f"kv_transfer_params.{field}")):
        KVTransferParams.from_dict({**FULL, **patch})


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="do_remote_prefil"):
        KVTransferParams.from_dict({"do_remote_prefil": True})


def test_not_a_dict():
    with pytest.raises(ValueError, match="must be an object"):
        KVTransferParams.from_dict(["do_remote_decode"])  # type: ignore[arg-type]
