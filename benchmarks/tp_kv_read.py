"""Section "kv-read" of benchmarks/tensor_parallel.py: KV READ across TP sizes.

For each KV layout and (P TP, D TP) pairing, every rank is its own process
with its own NIXL agent and KV shard (``tests/kvtransfer/tp_rank_process.py``,
the harness of the multi-process test). A request's KV of ``size`` MiB (all
heads, fresh blocks in a few runs each time) goes from P's ranks to D's
through the real connector: D's scheduler side plans, every D rank posts its
own READs (its heads, from the P ranks that hold them), P's lead frees on
every D rank's "done". READ time = first READ posted to last READ done over
all D ranks (their ``perf_counter`` stamps, one clock on one host); GB/s =
all bytes D's ranks read / READ time. Descriptors are per D rank per block.

The heterogeneous rows are compared with the homogeneous pairing that has
the same number of reading processes (D TP): (1, 2) and (2, 2), (2, 1) and
(1, 1). Run alone::

    .venv/bin/python benchmarks/tp_kv_read.py [--sizes-mib 16 64 256] [--iters 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402

# Llama-3-8B-like per layer (8 KV heads of 128, fp16), 16 layers, 16-token blocks:
# 1 MiB per block of all heads, 128 KiB per head-block
NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, DTYPE = 16, 16, 8, 128, "float16"
BLOCK_MIB = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 / 2**20
PAIRINGS = [(1, 1), (2, 2), (1, 2), (2, 1)]
LAYOUTS = ("blocks_first", "head_major")
HOMOGENEOUS = {1: (1, 1), 2: (2, 2), 4: (4, 4)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--iters", type=int, default=5, help="timed transfers per size")
    parser.add_argument(
        "--pairings",
        nargs="+",
        default=[f"{p}x{d}" for p, d in PAIRINGS],
        help="P TP x D TP, e.g. 1x2 2x1 (the homogeneous pairing of each D TP is added)",
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)


def _pick_blocks(rng, num_blocks: int, num_runs: int, limit: int) -> list[int]:
    """``num_blocks`` distinct ids below ``limit`` in ``num_runs`` runs, runs shuffled."""
    sizes = [num_blocks // num_runs + (i < num_blocks % num_runs) for i in range(num_runs)]
    slot = limit // num_runs
    runs = []
    for i, size in enumerate(sizes):
        start = i * slot + int(rng.integers(0, slot - size + 1))
        runs.append(list(range(start, start + size)))
    return [b for i in rng.permutation(num_runs) for b in runs[i]]


def _pull(d, scheduler, engine_id: str, request_id: str, params: dict, blocks: list[int]):
    """Every D rank loads its part; returns each rank's load record."""
    from tandem.scheduler.request import Request, RequestStatus
    from tandem.wire.engine_protocol import SamplingParams

    num_tokens = params["num_tokens"]
    req = Request(request_id, [0] * (num_tokens + 1), SamplingParams(), kv_transfer_params=params)
    num_external, _ = scheduler.get_num_new_matched_tokens(req, 0)
    scheduler.update_state_after_alloc(req, blocks, num_external)
    meta = scheduler.build_connector_meta(None)
    for rank in d.ranks:
        rank.send("meta", engine_id, meta)
    records = []
    for rank in d.ranks:
        _, _, out, recs = rank.wait(lambda m: m[0] == "recving" and m[1] == engine_id, 60.0)
        if out.invalid_block_ids or request_id not in out.finished_recving:
            raise RuntimeError(f"rank {rank.rank}: load of {request_id} failed: {out}")
        records.extend(r for r in recs if r[0] == request_id)
    from tandem.scheduler.messages import KVConnectorOutput

    scheduler.update_connector_output(KVConnectorOutput(finished_recving=[request_id]))
    req.status = RequestStatus.FINISHED_STOPPED
    scheduler.request_finished(req, blocks)
    return records


def _measure(pairings: list[tuple[int, int]], args: argparse.Namespace) -> list[dict]:
    """Every TP group runs all the time (one process per rank, each hosting both
    layouts' engines); the pairings take turns transfer by transfer, so a
    change of machine load hits them alike."""
    import numpy as np

    from tandem.kvtransfer import KVTransferConfig
    from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
    from tests.kvtransfer.tp_rank_process import EngineGroup, RankSpec

    max_blocks = int(max(args.sizes_mib) / BLOCK_MIB)
    num_blocks = max_blocks + 32
    geometry = dict(
        num_blocks=num_blocks,
        num_layers=NUM_LAYERS,
        block_size=BLOCK_SIZE,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
        random_kv=False,
    )

    def eid(role: str, tp: int, layout: str) -> str:
        return f"{role[0]}{tp}-{layout}"

    groups = {}
    try:
        for role, tps in (
            ("prefill", {p for p, _ in pairings}),
            ("decode", {d for _, d in pairings}),
        ):
            for tp in sorted(tps):
                specs = [
                    RankSpec(eid(role, tp, lay), role, tp, NUM_KV_HEADS, lay, **geometry)
                    for lay in args.layouts
                ]
                groups[role, tp] = EngineGroup(specs)
        for group in groups.values():
            group.wait_ready(180)
        schedulers = {}
        for layout in args.layouts:
            for d_tp in {d for _, d in pairings}:
                config = KVTransferConfig(
                    role="decode", engine_id=eid("decode", d_tp, layout), block_size=BLOCK_SIZE
                )
                schedulers[layout, d_tp] = NixlSchedulerSide(config)
                schedulers[layout, d_tp].set_prefill_endpoints(
                    [
                        groups["prefill", p_tp].endpoint(eid("prefill", p_tp, layout))
                        for p_tp in {p for p, _ in pairings}
                    ]
                )
        rng = np.random.default_rng(0)
        samples: dict[tuple, list[tuple[float, float]]] = {}
        for size in args.sizes_mib:
            n = int(size / BLOCK_MIB)
            for i in range(args.iters + 1):  # the first round warms up (handshakes)
                for layout in args.layouts:
                    for p_tp, d_tp in pairings:
                        p, d = groups["prefill", p_tp], groups["decode", d_tp]
                        p_eid, d_eid = eid("prefill", p_tp, layout), eid("decode", d_tp, layout)
                        rid = f"{layout}-{p_tp}x{d_tp}-{size}-{i}"
                        remote = _pick_blocks(rng, n, 3, num_blocks)
                        local = _pick_blocks(rng, n, 4, num_blocks)
                        params = p.finish(p_eid, rid, n * BLOCK_SIZE, remote)
                        scheduler = schedulers[layout, d_tp]
                        records = _pull(d, scheduler, d_eid, rid, params, local)
                        p.wait_freed(p_eid, rid)
                        if not i:
                            continue
                        seconds = max(r[5] for r in records) - min(r[4] for r in records)
                        gbs = sum(r[2] for r in records) / seconds / 1e9
                        descs = sum(r[3] for r in records) / len(records) / n
                        samples.setdefault((layout, p_tp, d_tp, size), []).append((gbs, descs))
    finally:
        for group in groups.values():
            group.close()
    return [
        {
            "layout": layout,
            "p": p_tp,
            "d": d_tp,
            "size": size,
            "gbs": statistics.median(g for g, _ in values),
            "descs": statistics.median(c for _, c in values),
        }
        for (layout, p_tp, d_tp, size), values in samples.items()
    ]


def section_kv_read(args: argparse.Namespace) -> None:
    pairings = [tuple(int(x) for x in s.split("x")) for s in args.pairings]
    for _, d_tp in list(pairings):
        if HOMOGENEOUS[d_tp] not in pairings:
            pairings.append(HOMOGENEOUS[d_tp])
    load_before = os.getloadavg()
    start = time.time()
    rows = _measure(pairings, args)
    order = {pairing: i for i, pairing in enumerate(pairings)}
    rows.sort(key=lambda r: (r["size"], r["layout"], order[r["p"], r["d"]]))
    load_after = os.getloadavg()
    by_key = {(r["layout"], r["p"], r["d"], r["size"]): r for r in rows}
    print(
        f"\n## KV READ across TP sizes (real NIXL/UCX between processes, one per rank; "
        f"{NUM_KV_HEADS} KV heads x {HEAD_DIM}, {NUM_LAYERS} layers, block {BLOCK_SIZE} "
        f"tokens, {DTYPE}: {BLOCK_MIB:.0f} MiB per block of all heads; median of "
        f"{args.iters} transfers after a warm-up, fresh blocks in 3-4 runs each; the pairings "
        "take turns transfer by transfer)"
    )
    print(
        f"machine: {machine()}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after ({time.time() - start:.0f} s)\n"
    )
    print(
        "| layout | P TP | D TP | size | descriptors / block / D rank | READ GB/s | vs homogeneous |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = by_key[(r["layout"], *HOMOGENEOUS[r["d"]], r["size"])]
        ratio = "(homogeneous)" if base is r else f"{r['gbs'] / base['gbs']:.0%}"
        print(
            f"| {r['layout']} | {r['p']} | {r['d']} | {r['size']} MiB | {r['descs']:.2f} "
            f"| {r['gbs']:.2f} | {ratio} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    section_kv_read(parser.parse_args())


if __name__ == "__main__":
    main()
