"""Where each tensor-parallel rank gets its own KV connector worker side.

Rank 0 lives in the engine core process and keeps the engine's connector
pair (``EngineCore._make_connector``): its scheduler side plans transfers for
the whole engine, its worker side moves rank 0's KV shard. Every other rank
``r`` builds its own worker side in its process, next to its KV shard::

    engine core (rank 0)                       worker process (rank r > 0)
    connector scheduler side -> metadata       make_rank_connector(config, hf_config, r)
    connector worker side (rank 0's shard)     .register_kv_caches(KV shard r)
        start_load_kv(meta) / get_finished()   .start_load_kv(same meta) / get_finished()
                 \\___ ConnectorOutputMerger (kvtransfer/tp_outputs.py) ___/

Every rank's ``KVTransferConfig`` (``kv_transfer_config``) names its rank,
the engine's TP size and the model's KV head count; a prefill rank serves
its own side channel, whose port the worker reports when ready
(``EngineCore.kv_rank_ports``), so decode engines reach every rank.
The metadata crosses to a worker as plain data and is converted back to the
worker side's ``metadata_type``.
"""

from __future__ import annotations

from typing import Any

from tandem.workers.config import EngineConfig


def kv_role(config: EngineConfig) -> str:
    """The engine's NIXL role: a prefill engine serves its KV, a decode engine reads
    peers'; an engine keeping a host KV tier does both, so it lends tier prefixes to
    its peers and borrows theirs (kvtransfer/tiers/export.py), whatever its pool. A
    prefill engine without a tier does both too where another pool keeps one
    (``kv_borrows_tiers``, set by ``tandem serve``): it borrows before it prefills. So does
    an engine that may move between the prefill and decode pools (``kv_pool_moves``): its
    connector serves either pool's requests without being rebuilt."""
    if config.offload.kv_offloading_size:
        return "both"
    if config.runtime.role == "prefill" and config.kv_transfer.borrows_tiers:
        return "both"
    if config.kv_transfer.pool_moves:  # it may switch pools while serving: serves and reads
        return "both"
    return {"prefill": "prefill", "decode": "decode"}.get(config.runtime.role, "both")


def kv_transfer_config(config: EngineConfig, hf_config: Any, rank: int = 0) -> Any:
    """The ``KVTransferConfig`` of rank ``rank`` of an engine (0: the engine core's):
    the kv_transfer section whole (its fields carry the connector's names), and
    what the connector learns from the other sections and the rank."""
    import dataclasses

    from tandem.kvtransfer.config import KVTransferConfig

    names = {f.name for f in dataclasses.fields(KVTransferConfig)}
    section = {
        f.name: getattr(config.kv_transfer, f.name)
        for f in dataclasses.fields(config.kv_transfer)
        if f.name in names
    }
    tp = config.parallel.tensor_parallel_size
    heads = hf_config.num_attention_heads
    model_kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if rank:  # other ranks: a free port, and one transport probe per engine (rank 0's)
        section.update(side_channel_port=0, transport_probe="off")
    return KVTransferConfig(
        **section,
        role=kv_role(config),
        engine_id=config.runtime.engine_id,
        epoch=config.runtime.epoch,
        block_size=config.cache.block_size,
        model_name=config.model.name,
        kv_layout=config.cache.kv_layout,
        cluster_secret=config.runtime.cluster_secret,
        tp_size=tp,
        tp_rank=rank,
        num_kv_heads=model_kv_heads if tp > 1 else None,
        device=config.model.device,
    )


def make_rank_connector(config: EngineConfig, hf_config: Any, rank: int) -> Any:
    """Rank ``rank``'s connector worker side, or None without a connector.
    (The pair's scheduler side is plain state, unused here: the engine core's plans.)
    KV tiers: the rank's own tiers, following rank 0's plan (kvtransfer/tiers/ranks.py;
    with a NIXL connector they are refused at config time)."""
    import dataclasses

    from tandem.kvtransfer.tiers.config import tier_config

    tiers = tier_config(config)
    if tiers.enabled:
        from tandem.kvtransfer.tiers.ranks import create_rank_tiers

        return create_rank_tiers(dataclasses.replace(tiers, tp_rank=rank))
    if not config.kv_transfer.connector:
        return None
    from tandem.kvtransfer.registry import create_connector

    _, worker = create_connector(kv_transfer_config(config, hf_config, rank))
    return worker
