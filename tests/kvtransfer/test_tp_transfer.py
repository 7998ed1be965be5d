"""KV transfer between engines of different tensor-parallel sizes over real NIXL.

Every rank is its own NIXL agent in its own OS process (``tp_rank_process.py``):
P TP 1 (1 process), P TP 2 (2), D TP 1 (1), D TP 2 (2). Each process hosts
that rank of three engine variants: 2 KV heads head-major, 2 KV heads
blocks-first, 1 KV head head-major (replicated on TP 2). This process runs
the decode engines' scheduler sides and merges their ranks' outputs
(``ConnectorOutputMerger``), as a TP engine's core does.

For (P TP, D TP) in {(1, 2), (2, 1), (2, 2)}: D's blocks hold exactly the
expected head slices of P's KV (byte equality), each D rank read exactly
blocks x its shard's bytes in the planned number of descriptors, a partial
prefix hit on D reads only the missing blocks on every rank, P frees only
after every D rank's "done", and a replicated head is read once (P's other
replica is never even handshaked).
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest

from tandem.kvtransfer import KVTransferConfig
from tandem.kvtransfer.compat import BLOCKS_FIRST, HEAD_MAJOR
from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
from tandem.kvtransfer.tp_outputs import ConnectorOutputMerger
from tandem.kvtransfer.tp_plan import shard_for
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams
from tests.kvtransfer.tp_rank_process import (
    BLOCK_SIZE,
    NUM_LAYERS,
    EngineGroup,
    RankSpec,
    model_kv,
    shard_block_bytes,
)

pytestmark = pytest.mark.slow

# variant -> (KV heads, layout)
VARIANTS = {"hm2": (2, HEAD_MAJOR), "bf2": (2, BLOCKS_FIRST), "hm1": (1, HEAD_MAJOR)}
PAIRINGS = [(1, 2), (2, 1), (2, 2)]


def engine_id(role: str, tp: int, variant: str) -> str:
    return f"{role[0]}{tp}-{variant}"


def engine(role: str, tp: int) -> EngineGroup:
    """The ranks of one TP group, each process hosting that rank of every variant."""
    specs = [
        RankSpec(engine_id(role, tp, v), role, tp, heads, layout, seed=tp)
        for v, (heads, layout) in VARIANTS.items()
    ]
    return EngineGroup(specs)


@pytest.fixture(scope="module")
def cluster():
    groups: dict[tuple[str, int], EngineGroup] = {}
    with contextlib.ExitStack() as stack:
        for role, tp in itertools.product(("prefill", "decode"), (1, 2)):
            groups[role, tp] = engine(role, tp)
            stack.callback(groups[role, tp].close)
        for group in groups.values():  # all processes start at once; then wait
            group.wait_ready()
        yield groups


def decode_scheduler(variant: str, d_tp: int, prefills: list[EngineGroup]) -> NixlSchedulerSide:
    config = KVTransferConfig(
        role="decode", engine_id=engine_id("decode", d_tp, variant), block_size=BLOCK_SIZE
    )
    scheduler = NixlSchedulerSide(config)
    scheduler.set_prefill_endpoints(
        [p.endpoint(engine_id("prefill", p.tp, variant)) for p in prefills]
    )
    return scheduler


def pull(d, scheduler, variant, request_id, params, num_prompt, d_blocks, num_local=0, lead=None):
    """D's scheduler side + every D rank until the merged output finishes the
    request. With ``lead`` (P's lead rank process), D's ranks get the step one
    after the other, and P must not free before the last one is done."""
    eid = engine_id("decode", d.tp, variant)
    req = Request(
        request_id,
        list(range(num_prompt + 1)),
        SamplingParams(max_tokens=4),
        kv_transfer_params=params,
    )
    num_external, _ = scheduler.get_num_new_matched_tokens(req, num_local)
    scheduler.update_state_after_alloc(req, d_blocks, num_external)
    meta = scheduler.build_connector_meta(None)
    merger = ConnectorOutputMerger(d.tp)
    merged = None
    for rank in d.ranks:
        if lead is not None and rank.rank > 0:  # ranks 0..r-1 are done, r.. not started
            with pytest.raises(TimeoutError):
                lead.wait(
                    lambda m: m[0] == "done_sending" and m[2] == params["remote_request_id"], 0.3
                )
        rank.send("meta", eid, meta)
        if lead is None and rank is not d.ranks[-1]:
            continue
        for waited in d.ranks if lead is None else [rank]:
            out = waited.wait(lambda m: m[0] == "recving" and m[1] == eid, 30.0)[2]
            outputs = [None] * d.tp
            outputs[waited.rank] = out
            merged = merger.merge(outputs) or merged
            # the engine sees the request only once every rank has it
            assert (merged is not None and request_id in merged.finished_recving) == (
                waited is d.ranks[-1]
            )
    merger.check_integrity()
    scheduler.update_connector_output(merged)
    req.status = RequestStatus.FINISHED_STOPPED
    scheduler.request_finished(req, d_blocks)
    scheduler.check_integrity()
    return num_external, set(merged.invalid_block_ids)


def expected_descriptors(variant: str, p_tp: int, d_tp: int, num_blocks: int, num_runs: int) -> int:
    """Per D rank: whole blocks -> one per run; a head slice -> one per block
    head-major, L*2*bs per block blocks-first (one part per P rank read)."""
    heads, layout = VARIANTS[variant]
    if p_tp == d_tp or (heads == 1 and p_tp > d_tp):  # whole blocks from one P rank
        return num_runs
    if p_tp > d_tp:  # 2 heads, P TP 2 -> D TP 1: one head from each P rank
        parts = 2
    else:  # D TP 2 <- P TP 1: a head's slice of P's 2-head blocks (or the whole 1-head block)
        parts = 1
        if heads == 1:
            return num_runs
    per_block = 1 if layout == HEAD_MAJOR else NUM_LAYERS * 2 * BLOCK_SIZE
    return parts * num_blocks * per_block


@pytest.mark.parametrize("p_tp,d_tp", PAIRINGS)
def test_reads_across_tp_sizes_are_byte_exact(cluster, p_tp, d_tp):
    p, d = cluster["prefill", p_tp], cluster["decode", d_tp]
    for variant, (heads, layout) in VARIANTS.items():
        p_eid, d_eid = engine_id("prefill", p_tp, variant), engine_id("decode", d_tp, variant)
        where = f"{variant} P TP {p_tp} -> D TP {d_tp}"
        scheduler = decode_scheduler(variant, d_tp, [p])
        before = [d_rank.ask("stats", d_eid)[1] for d_rank in d.ranks]
        served_before = [r.ask("stats", p_eid)[1]["handshakes_served"] for r in p.ranks]
        full = model_kv(heads, seed=p_tp)
        lead = p.ranks[0]
        # 4 blocks (the last partial): P [9, 10, 3, 4] -> D [2, 3, 4, 11]
        p_blocks, d_blocks = [9, 10, 3, 4], [2, 3, 4, 11]
        rid = f"{variant}-{p_tp}-{d_tp}"
        params = p.finish(p_eid, rid, 15, p_blocks)
        got = pull(d, scheduler, variant, rid, params, 15, d_blocks, lead=lead)
        assert got == (15, set()), where
        p.wait_freed(p_eid, rid)  # after EVERY D rank's "done"

        # partial prefix hit on D: the first 2 blocks are local, only 2 travel per rank
        for d_rank in d.ranks:
            d_rank.ask("fill", d_eid, [14, 15], 7.0)
        hit_p, hit_d = [5, 6, 7, 8], [14, 15, 16, 17]
        params = p.finish(p_eid, rid + "-hit", 16, hit_p)
        got = pull(d, scheduler, variant, rid + "-hit", params, 16, hit_d, num_local=8)
        assert got == (8, set()), where
        p.wait_freed(p_eid, rid + "-hit")

        for d_rank, old in zip(d.ranks, before):
            shard = shard_for(heads, d_tp, d_rank.rank)
            expected = shard_block_bytes(full, shard.head_start, shard.num_heads, layout)
            at = f"{where}, D rank {d_rank.rank}"
            blocks = d_rank.ask("blocks", d_eid, d_blocks + hit_d)[1]
            assert np.array_equal(blocks[:4], expected[p_blocks]), at
            assert np.all(blocks[4:6].view(np.float32) == 7.0), at  # the local hit: untouched
            assert np.array_equal(blocks[6:], expected[hit_p[2:]]), at
            stats = d_rank.ask("stats", d_eid)[1]
            num_bytes = stats["kv_transfer_bytes_total"] - old["kv_transfer_bytes_total"]
            assert num_bytes == (4 + 2) * expected.shape[1], at  # blocks x this rank's block
            descriptors = stats["num_descriptors"] - old["num_descriptors"]
            assert descriptors == expected_descriptors(
                variant, p_tp, d_tp, 4, 3
            ) + expected_descriptors(variant, p_tp, d_tp, 2, 1), at
            assert stats["num_failures"] == 0, at
        for rank in p.ranks:  # the lead freed on D's "done"s; the others were told
            p_stats = rank.ask("stats", p_eid)[1]
            assert p_stats["num_blocks_held_for_transfer"] == 0, where
            assert p_stats["num_lease_expiries"] == 0, where
        served = [
            r.ask("stats", p_eid)[1]["handshakes_served"] - n
            for r, n in zip(p.ranks, served_before)
        ]
        if (variant, p_tp, d_tp) == ("hm1", 2, 1):
            # 1 KV head on P TP 2: both P ranks hold it, D TP 1 reads rank 0's copy only
            # and never even handshakes with rank 1
            assert served == [1, 0], where
        elif p_tp == 2:  # every P rank is read (by one D rank, or by D's only rank)
            assert served == [1, 1], where
