"""One worker rank of tensor-parallel engines in its own OS process, driven over a pipe.

A rank process hosts the rank-``r`` connector worker side of one or more
engines (``RankSpec``): each is its own NIXL agent that registers its own KV
shard and serves its own side channel, exactly like a TP worker process of
an engine. A prefill engine's lead rank also runs the engine's scheduler side
(it hands out kv_transfer_params and frees on "done"). Prefill shards hold
the heads of a seeded "model KV" (``model_kv``); decode shards start zeroed.

    parent -> child  ("finish", engine, request_id, num_prompt, block_ids)
                     -> ("params", request_id, params, P's step metadata)   (prefill lead)
    parent -> child  ("meta", engine, NixlConnectorMetadata)   one step's metadata (every
                     rank of an engine gets the same, as a TP engine broadcasts it)
    child -> parent  ("recving", engine, KVConnectorOutput, load records)  this rank's
                     finished loads (records: NixlWorkerSide.drain_load_records)
    child -> parent  ("done_sending", engine, request_id, P's next step metadata) (lead)
    parent -> child  ("blocks", engine, block_ids) -> ("blocks", bytes of those blocks)
    parent -> child  ("fill", engine, block_ids, value) -> ("filled",)
    parent -> child  ("stats", engine) -> ("stats", worker stats + handshakes served)
    parent -> child  ("stop",)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests.kvtransfer.prefill_process import ChildProcess, finish_prefill

# the tests' "model": [blocks, layers, K/V, block_size, kv heads, head dim] float32
NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, HEAD_DIM = 24, 2, 4, 8


@dataclasses.dataclass(frozen=True)
class RankSpec:
    engine_id: str
    role: str  # "prefill" | "decode"
    tp_size: int
    num_kv_heads: int
    layout: str
    seed: int = 0
    # geometry (the benchmark's is larger); dtype a torch dtype name
    num_blocks: int = NUM_BLOCKS
    num_layers: int = NUM_LAYERS
    block_size: int = BLOCK_SIZE
    head_dim: int = HEAD_DIM
    dtype: str = "float32"
    random_kv: bool = True  # prefill shards hold model_kv (else a cheap fill)


def model_kv(num_kv_heads: int, seed: int, spec: RankSpec | None = None) -> np.ndarray:
    """The full (all heads) KV a prefill engine's ranks split between them."""
    g = spec or RankSpec("", "prefill", 1, num_kv_heads, "", seed)
    rng = np.random.default_rng(seed)
    shape = (g.num_blocks, g.num_layers, 2, g.block_size, num_kv_heads, g.head_dim)
    return rng.standard_normal(shape).astype(np.float32)


def shard_block_bytes(full: np.ndarray, head_start: int, num_heads: int, layout: str) -> np.ndarray:
    """Per block, the bytes a rank holding those heads stores (storage order)."""
    from tandem.kvtransfer.compat import STORAGE_ORDER

    part = full[:, :, :, :, head_start : head_start + num_heads, :]
    part = np.ascontiguousarray(part.transpose(STORAGE_ORDER[layout]))
    return part.view(np.uint8).reshape(full.shape[0], -1)


def _build(spec: RankSpec, rank: int):
    import torch

    from tandem.kvtransfer import KVTransferConfig, create_connector
    from tandem.kvtransfer.nixl_worker import NixlWorkerSide
    from tandem.workers.runner.kv_cache import allocate_kv_cache

    config = KVTransferConfig(
        role=spec.role,
        engine_id=spec.engine_id,
        epoch=1,
        block_size=spec.block_size,
        model_name="tp-test",
        num_kv_heads=spec.num_kv_heads,
        kv_layout=spec.layout,
        tp_size=spec.tp_size,
        tp_rank=rank,
        lease_s=30.0,
    )
    scheduler = None
    if spec.role == "prefill" and rank == 0:
        scheduler, worker = create_connector(config)
    else:
        worker = NixlWorkerSide(config)
    from tandem.kvtransfer.tp_plan import shard_for

    shard = shard_for(spec.num_kv_heads, spec.tp_size, rank)
    kv = allocate_kv_cache(
        spec.num_blocks,
        spec.num_layers,
        spec.block_size,
        shard.num_heads,
        spec.head_dim,
        getattr(torch, spec.dtype),
        torch.device("cpu"),
        layout=spec.layout,
    )
    if spec.role == "prefill" and spec.random_kv:
        full = model_kv(spec.num_kv_heads, spec.seed, spec)
        heads = full[:, :, :, :, shard.head_start : shard.head_start + shard.num_heads, :]
        kv.copy_(torch.from_numpy(np.ascontiguousarray(heads)))
    elif spec.role == "prefill":
        kv.fill_(1.0 + rank)
    worker.register_kv_caches(kv)
    return scheduler, worker, kv


def run_rank(conn, specs: list[RankSpec], rank: int) -> None:
    from tandem.kvtransfer.compat import STORAGE_ORDER
    from tandem.scheduler.messages import KVConnectorOutput

    engines: dict[str, Any] = {s.engine_id: (s, *_build(s, rank)) for s in specs}
    conn.send(("ready", {e: w.side_channel_port for e, (_, _, w, _) in engines.items()}))
    try:
        while True:
            if conn.poll(0.002):
                msg = conn.recv()
                kind = msg[0]
                if kind == "stop":
                    return
                spec, scheduler, worker, kv = engines[msg[1]]
                if kind == "finish":
                    _, _, request_id, num_prompt, block_ids = msg
                    params, meta = finish_prefill(scheduler, request_id, num_prompt, block_ids)
                    worker.start_load_kv(meta)
                    conn.send(("params", request_id, params, meta))
                elif kind == "meta":
                    worker.start_load_kv(msg[2])
                elif kind == "blocks":
                    storage = kv.permute(*STORAGE_ORDER[spec.layout])
                    rows = storage[list(msg[2])].contiguous().view(-1).numpy().view(np.uint8)
                    conn.send(("blocks", rows.reshape(len(msg[2]), -1).copy()))
                elif kind == "fill":
                    kv[list(msg[2])] = msg[3]
                    conn.send(("filled",))
                elif kind == "stats":
                    served = worker._server.num_handshakes_served if worker._server else 0
                    conn.send(("stats", {**worker.stats(), "handshakes_served": served}))
            for engine_id, (_, scheduler, worker, _) in engines.items():
                sending, recving = worker.get_finished()
                errors = worker.get_block_ids_with_load_errors()
                if scheduler is not None and sending:
                    scheduler.update_connector_output(
                        KVConnectorOutput(finished_sending=sorted(sending))
                    )
                    meta = scheduler.build_connector_meta(None)  # the engine's next step
                    worker.start_load_kv(meta)
                    for request_id in sorted(sending):
                        conn.send(("done_sending", engine_id, request_id, meta))
                if recving or errors:
                    out = KVConnectorOutput(
                        finished_recving=sorted(recving), invalid_block_ids=sorted(errors)
                    )
                    conn.send(("recving", engine_id, out, worker.drain_load_records()))
    finally:
        for _, _, worker, _ in engines.values():
            worker.shutdown()


class RankProcess(ChildProcess):
    """Parent-side handle of one rank process."""

    def __init__(self, specs: list[RankSpec], rank: int) -> None:
        self.rank = rank
        self.what = f"rank {rank} process"
        super().__init__(run_rank, (specs, rank))
        self.ports: dict[str, int] = {}

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        self.ports = self.wait(lambda m: m[0] == "ready", timeout_s)[1]

    def ask(self, *msg: Any) -> tuple:
        reply = {"finish": "params", "blocks": "blocks", "fill": "filled", "stats": "stats"}
        self.send(*msg)
        return self.wait(lambda m: m[0] == reply[msg[0]])


class EngineGroup:
    """Every rank of TP engines as ``tp`` processes; rank r hosts rank r of each
    spec (all specs share one TP size). P's step metadata reaches every rank,
    as a TP engine broadcasts it."""

    def __init__(self, specs: list[RankSpec]) -> None:
        self.tp = specs[0].tp_size
        assert all(s.tp_size == self.tp for s in specs)
        self.ranks = [RankProcess(specs, r) for r in range(self.tp)]

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        for rank in self.ranks:
            rank.wait_ready(timeout_s)

    def finish(
        self, engine_id: str, request_id: str, num_prompt: int, block_ids: list[int]
    ) -> dict:
        """The prefill lead finishes a request; returns its kv_transfer_params."""
        _, _, params, meta = self.ranks[0].ask(
            "finish", engine_id, request_id, num_prompt, block_ids
        )
        for rank in self.ranks[1:]:
            rank.send("meta", engine_id, meta)
        return params

    def wait_freed(self, engine_id: str, request_id: str, timeout_s: float = 20.0) -> None:
        """The lead reports the send done (every decode rank said "done")."""
        done = self.ranks[0].wait(
            lambda m: m[:3] == ("done_sending", engine_id, request_id), timeout_s
        )
        for rank in self.ranks[1:]:
            rank.send("meta", engine_id, done[3])

    def endpoint(self, engine_id: str) -> list:
        """What the cluster registers with decode engines for this prefill engine."""
        ports = [r.ports[engine_id] for r in self.ranks]
        return [engine_id, 1, "127.0.0.1", ports[0], ports]

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
