"""What must match between engines of different TP sizes, what may differ, and
how one engine's ranks' connector outputs become one."""

from __future__ import annotations

import pytest

from tandem.kvtransfer import KVTransferConfig
from tandem.kvtransfer.compat import HEAD_MAJOR, KVLayout, RankLayout, compat_hash
from tandem.kvtransfer.nixl_meta import NotifKey, PeerAddr, decode_notif, encode_notif
from tandem.kvtransfer.prefill_registry import PrefillRegistry
from tandem.kvtransfer.tp_outputs import ConnectorOutputMerger
from tandem.scheduler.messages import KVConnectorOutput
from tandem.wire.engine_protocol import SamplingParams


def test_hash_covers_the_model_not_the_tp_size():
    # what must match is hashed (test_config checks each field changes the hash) ...
    assert set(KVLayout.__struct_fields__) == {
        "model_name",
        "dtype",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "block_size",
        "layout",
        "connector_version",
    }
    # ... what may differ travels beside it, per rank, never hashed
    assert set(RankLayout.__struct_fields__) == {
        "tp_size",
        "rank",
        "head_start",
        "num_heads",
        "replicated",
    }
    layout = KVLayout("tiny", "float32", 4, 8, 16, 16, HEAD_MAJOR)
    assert compat_hash(layout) == compat_hash(KVLayout("tiny", "float32", 4, 8, 16, 16, HEAD_MAJOR))
    assert compat_hash(layout) != compat_hash(KVLayout("tiny", "float32", 4, 8, 16, 16))


def test_tp_config_is_validated():
    with pytest.raises(ValueError, match="KVTransferConfig.tp_rank must be in 0..1"):
        KVTransferConfig(tp_size=2, tp_rank=2, num_kv_heads=4)
    with pytest.raises(ValueError, match="KVTransferConfig.tp_size must be an int >= 1"):
        KVTransferConfig(tp_size=0)
    with pytest.raises(ValueError, match=r"KVTransferConfig.num_kv_heads \(the model's\)"):
        KVTransferConfig(tp_size=2)
    with pytest.raises(ValueError, match="KVTransferConfig.kv_layout must be one of"):
        KVTransferConfig(kv_layout="layers_first")
    assert KVTransferConfig(tp_size=2, tp_rank=1, num_kv_heads=4).is_lead_rank is False


def test_peer_addr_ranks():
    one = PeerAddr("p", 1, "h", 5000)
    assert (one.tp_size, one.rank_port(0)) == (1, 5000)
    two = PeerAddr("p", 1, "h", 5000, (5000, 5007))
    assert (two.tp_size, two.rank_port(1)) == (2, 5007)


def test_notifications_name_their_rank():
    assert encode_notif("done", "r1") == b"done:r1"
    assert decode_notif(b"done:r1") == NotifKey("done", "r1")
    assert decode_notif(encode_notif("done", "a:b", 1, 2)) == NotifKey("done", "a:b", 1, 2)
    for bad in (b"done@2/2:r", b"done@x/2:r", b"nope:r", b"done"):
        assert decode_notif(bad) is None, bad


def test_merger_waits_for_every_rank_and_keeps_their_errors():
    merger = ConnectorOutputMerger(2)
    # rank 1 finished "a" with a failed block; rank 0 not yet; rank 0 (lead) freed a send
    out = merger.merge(
        [
            KVConnectorOutput(finished_sending=["s"]),
            KVConnectorOutput(finished_recving=["a"], invalid_block_ids=[7]),
        ]
    )
    assert out == KVConnectorOutput(finished_sending=["s"])
    with pytest.raises(AssertionError, match=r"'a': \[1\]"):
        merger.check_integrity()
    out = merger.merge([KVConnectorOutput(finished_recving=["a", "b"]), None])
    assert out == KVConnectorOutput(finished_recving=["a"], invalid_block_ids=[7])
    out = merger.merge([None, KVConnectorOutput(finished_recving=["b"])])
    assert out == KVConnectorOutput(finished_recving=["b"])
    assert merger.merge([None, None]) is None
    merger.check_integrity()
    with pytest.raises(ValueError, match="1 outputs for 2 ranks"):
        merger.merge([None])


def test_registered_prefill_engine_lists_its_rank_side_channels():
    registry = PrefillRegistry()
    registry.replace([["p0", 2, "10.0.0.1", 5000, [5000, 5001]], ["p1", 1, "10.0.0.2", 6000]])
    assert registry.lookup("p0", 2) == (PeerAddr("p0", 2, "10.0.0.1", 5000, (5000, 5001)), "")
    assert registry.lookup("p1", 1)[0].tp_size == 1
    with pytest.raises(ValueError, match="rank_ports must be ports starting with port 5000"):
        registry.replace([["p0", 2, "10.0.0.1", 5000, [5001, 5000]]])
    with pytest.raises(ValueError, match="rank_ports must be ports"):
        registry.replace([["p0", 2, "10.0.0.1", 5000, [5000, 0]]])


def test_a_tp_prefill_engine_tells_its_other_ranks_what_it_freed():
    """Only the lead rank reports a send done; the scheduler side passes the
    engine's frees on in the next step's metadata (finished_sends), so the
    other ranks stop tracking the send. One rank: nobody to tell."""
    from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
    from tandem.scheduler.request import Request, RequestStatus

    for tp_size, expected in ((2, ["r1"]), (1, [])):
        config = KVTransferConfig(role="prefill", block_size=4, tp_size=tp_size, num_kv_heads=2)
        conn = NixlSchedulerSide(config)
        req = Request(
            "r1",
            list(range(6)),
            SamplingParams(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True},
        )
        req.num_computed_tokens = 6
        req.append_output_token(9)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert conn.request_finished(req, [3, 4])[0] is True
        assert [s.request_id for s in conn.build_connector_meta(None).new_sends] == ["r1"]
        conn.update_connector_output(KVConnectorOutput(finished_sending=["r1"]))
        assert conn.has_pending_work() is bool(expected)  # one more step delivers it
        meta = conn.build_connector_meta(None)
        assert meta.finished_sends == expected and meta.is_empty() is not bool(expected)
        assert not conn.has_pending_work()
        conn.check_integrity()
