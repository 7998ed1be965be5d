"""``EngineConfig`` as a tree of sections: the flat keys map onto it both ways, and
the scheduler's and the KV connector's configs take their section whole."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from tandem.kvtransfer.config import KVTransferConfig
from tandem.scheduler.config import SchedulerConfig, SchedulingConfig
from tandem.workers.config import (
    ENGINE_SECTIONS,
    SECTIONS,
    CacheConfig,
    EngineConfig,
    KVTransferSection,
    engine_fields,
    engine_leaf,
)
from tandem.workers.engine.startup import scheduler_config
from tandem.workers.parallel.connector_hook import kv_transfer_config


def test_every_section_is_listed_and_every_key_is_unique():
    assert list(SECTIONS) == list(ENGINE_SECTIONS)
    keys = [leaf.key for leaf in engine_fields(internal=True)]
    assert len(keys) == len(set(keys))
    assert engine_leaf("kv_lease_s").section == "kv_transfer"
    assert engine_leaf("kv_lease_s").name == "lease_s"
    assert engine_leaf("model").section == "model" and engine_leaf("model").name == "name"


def test_from_flat_puts_each_key_in_its_section():
    c = EngineConfig.from_flat(model="tiny", max_num_seqs=8, block_size=32, kv_lease_s=5.0)
    assert c.model.name == "tiny" and c.scheduler.max_num_seqs == 8
    assert c.cache.block_size == 32 and c.kv_transfer.lease_s == 5.0
    assert c.get("kv_lease_s") == 5.0
    # no flat attribute: readers go through the sections
    assert not hasattr(c, "max_num_seqs") and not hasattr(c, "kv_lease_s")


def test_unknown_key_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="max_num_sequences"):
        EngineConfig.from_flat(max_num_sequences=8)
    with pytest.raises(ValueError, match="lease_s"):
        EngineConfig().replace(lease_s=1.0)  # the leaf's name is not its key


def test_bad_value_names_the_setting():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_flat(max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_transport_probe"):
        EngineConfig.from_flat(kv_transport_probe="sometimes")
    # a leaf named otherwise in its section is named by its key
    with pytest.raises(ValueError, match="output_stall_timeout_s must be > 0"):
        EngineConfig.from_flat(output_stall_timeout_s=0)


def test_replace_copies_every_section_and_leaves_the_original():
    a = EngineConfig.from_flat(max_num_seqs=8)
    b = a.replace(max_num_seqs=16, model="smollm2", role="decode")
    assert (a.scheduler.max_num_seqs, b.scheduler.max_num_seqs) == (8, 16)
    assert (b.model.name, b.runtime.role) == ("smollm2", "decode")
    assert a.model.name == "tiny" and a.runtime.role == "colocated"
    assert all(getattr(a, s) is not getattr(b, s) for s in SECTIONS)
    whole = a.replace(cache=CacheConfig(block_size=8))
    assert whole.cache.block_size == 8 and whole.scheduler.max_num_seqs == 8


def test_flat_round_trips():
    c = EngineConfig.from_flat(max_num_seqs=8, kv_port=1234, speculative_config=None)
    assert EngineConfig.from_flat(**c.flat()) == c
    assert set(c.flat(internal=False)) == {leaf.key for leaf in engine_fields()}
    assert "kv_port" in c.flat() and "engine_id" not in c.flat(internal=False)


def test_shared_defaults_come_from_the_consumer():
    assert CacheConfig().block_size == SchedulerConfig().block_size
    assert CacheConfig().prefix_caching_hash_algo == SchedulerConfig().prefix_caching_hash_algo
    assert CacheConfig().kv_layout == KVTransferConfig().kv_layout
    section, kv = KVTransferSection(), KVTransferConfig()
    for f in dataclasses.fields(section):
        if hasattr(kv, f.name) and f.name != "connector":  # None: no connector
            assert getattr(section, f.name) == getattr(kv, f.name), f.name


def test_scheduler_config_takes_the_scheduling_section_whole():
    changed = dict(
        max_num_seqs=7, max_num_batched_tokens=512, enable_chunked_prefill=False,
        long_prefill_token_threshold=64, policy="priority", kv_admission_margin=0.1,
        max_num_partial_prefills=3, max_long_partial_prefills=1,
    )  # fmt: skip
    assert set(changed) == {f.name for f in dataclasses.fields(SchedulingConfig)}
    config = EngineConfig.from_flat(block_size=8, load_failure_policy="fail", **changed)
    sched = scheduler_config(config, num_blocks=100, max_model_len=256)
    assert {k: getattr(sched, k) for k in changed} == changed
    assert (sched.num_kv_blocks, sched.max_model_len, sched.block_size) == (100, 256, 8)
    assert sched.load_failure_policy == "fail"


def test_kv_transfer_config_takes_the_section_whole():
    config = EngineConfig.from_flat(
        kv_connector="nixl", kv_host="10.0.0.7", kv_port=5555, kv_lease_s=7.0,
        kv_load_timeout_s=3.0, load_failure_policy="fail", kv_transport_probe="on",
        role="decode", engine_id="decode-3", epoch=2, block_size=8, kv_layout="head_major",
        tensor_parallel_size=2,
    )  # fmt: skip
    hf = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    kv = kv_transfer_config(config, hf)
    assert (kv.connector, kv.side_channel_host, kv.side_channel_port) == ("nixl", "10.0.0.7", 5555)
    assert (kv.lease_s, kv.load_timeout_s, kv.load_failure_policy) == (7.0, 3.0, "fail")
    assert (kv.role, kv.engine_id, kv.epoch, kv.block_size) == ("decode", "decode-3", 2, 8)
    assert (kv.kv_layout, kv.transport_probe, kv.tp_rank) == ("head_major", "on", 0)
    assert (kv.tp_size, kv.num_kv_heads) == (2, 2)  # the model's KV heads, for the shards
    rank1 = kv_transfer_config(config, hf, rank=1)
    assert (rank1.side_channel_port, rank1.transport_probe, rank1.tp_rank) == (0, "off", 1)
