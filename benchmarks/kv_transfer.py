"""KV transfer between two processes over NIXL/UCX, vs a torch copy.

Run from the repository root::

    .venv/bin/python benchmarks/kv_transfer.py
    .venv/bin/python benchmarks/kv_transfer.py --ucx-tls tcp --progress-thread --notify nixl
    .venv/bin/python benchmarks/kv_transfer.py --device cuda   # KV in VRAM, device copies

(The two processes and the device copies: ``benchmarks/kv_read_pair.py``.)

A prefill process (P) registers a blocks-first KV cache; this process (D)
pulls requests through the real connector (scheduler side -> metadata ->
worker side -> NIXL READ -> "done" notification -> P frees).

* Throughput: 1/16/64/256 MiB requests laid out as real KV blocks, a few
  runs each (so a few descriptors), NIXL READ time vs ``Tensor.copy_`` of
  the same runs inside one process.
* Handoff latency: a one-block request, from P having its
  kv_transfer_params to P processing D's "done" notification (the blocks
  are filled before that), after the first handshake; p50/p99.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.kv_read_pair import (  # noqa: E402
    NUM_BLOCKS,
    SEED,
    ReadPair,
    device_name,
    no_device_message,
    pick_blocks,
    timed_copy_s,
)


def throughput_row(pair: ReadPair, size_mib: int, rng, iters: int) -> dict:
    import torch

    block_bytes = pair.block_bytes
    num_blocks = size_mib * 2**20 // block_bytes
    num_bytes = num_blocks * block_bytes
    # fresh blocks every transfer (a few runs each, not in address order)
    layouts = [
        (pick_blocks(rng, num_blocks, 3, NUM_BLOCKS), pick_blocks(rng, num_blocks, 4, NUM_BLOCKS))
        for _ in range(iters + 1)
    ]
    # the same layout copied inside one process right after each READ (so both
    # see the same machine load); on CPU with 1 thread (like the kernel's
    # single-threaded cma copy) and with torch's default threads, on a GPU once
    src = torch.empty_like(pair.kv).fill_(1.0)
    default_threads = torch.get_num_threads()
    on_cpu = pair.device == "cpu"
    copy_s: dict[int, list[float]] = {1: [], default_threads: []} if on_cpu else {0: []}
    read_s, wall_s = [], []
    num_descs: list[int] = []  # what the connector posted per READ
    for i, (local, remote) in enumerate(layouts):  # the first one warms up
        rid = f"tp-{size_mib}-{i}"
        params = pair.finish(rid, remote)
        t0 = time.perf_counter()
        pair.pull(rid, params, local)
        wall = time.perf_counter() - t0
        (read,) = pair.worker.drain_transfer_seconds()
        ((*_, descs, _, _),) = pair.worker.drain_load_records()
        num_descs.append(descs)
        pair.prefill.wait_done_sending(rid)
        for threads in copy_s:
            if threads:
                torch.set_num_threads(threads)
            copy = timed_copy_s(pair.kv, src, local, remote, pair.device)
            if i:
                copy_s[threads].append(copy)
        torch.set_num_threads(default_threads)
        if i:
            read_s.append(read)
            wall_s.append(wall)
    del src
    copy_gbs = {t: num_bytes / statistics.median(v) / 1e9 for t, v in copy_s.items()}
    read_gbs = num_bytes / statistics.median(read_s) / 1e9
    return {
        "size": f"{size_mib} MiB",
        "blocks": num_blocks,
        "descs": f"{min(num_descs)}-{max(num_descs)}",
        "nixl": read_gbs,
        "wall": num_bytes / statistics.median(wall_s) / 1e9,
        "copy1": copy_gbs.get(1, copy_gbs.get(0)),
        "copyn": copy_gbs.get(default_threads, copy_gbs.get(0)),
        "ratio": read_gbs / max(copy_gbs.values()),
    }


def handoff(pair: ReadPair, iters: int) -> tuple[list[float], list[float]]:
    """(P: params ready -> D's done processed, D: params received -> blocks filled)."""
    p_lat, d_lat = [], []
    for i in range(iters + 5):
        rid = f"h-{i}"
        params = pair.finish(rid, [i % NUM_BLOCKS])
        t0 = time.perf_counter()
        pair.pull(rid, params, [(i * 7) % NUM_BLOCKS])
        d_s = time.perf_counter() - t0
        p_s = pair.prefill.wait_done_sending(rid)
        if i >= 5:
            p_lat.append(p_s)
            d_lat.append(d_s)
    return p_lat, d_lat


SETUP_CASES = {  # name -> (D blocks, P blocks) of one READ
    "1 block": ([100], [300]),
    "32 blocks, 1 run": (list(range(100, 132)), list(range(300, 332))),
    "32 blocks, 32 runs": (list(range(0, 64, 2)), list(range(1, 64, 2))),
    "512 blocks, 6 runs": (
        [*range(0, 171), *range(300, 471), *range(600, 770)],
        [*range(0, 128), *range(200, 328), *range(400, 528), *range(700, 828)],
    ),
    "512 blocks, 512 runs": (list(range(0, 1024, 2)), list(range(1, 1024, 2))),
}


def setup_cost_us(device: str, iters: int = 200) -> dict[str, tuple[float, float, int]]:
    """Per ``SETUP_CASES`` entry: median microseconds to go from a load's
    block ids to a READ handle (made and freed, nothing transferred) the two
    ways the connector can, and the descriptors both give:

    * addresses: ``tp_plan.read_descriptors`` (runs merged in local order),
      then NIXL prepares both lists for this READ (``initialize_xfer``)
    * prepped lists: block ids sorted by local id index lists NIXL prepared
      once (``make_prepped_xfer``, ``kvtransfer/prepped_blocks.py``), which
      merges the same runs

    Two agents in this process, one-head 512-byte blocks."""
    import torch

    from tandem.kvtransfer.compat import BLOCKS_FIRST
    from tandem.kvtransfer.nixl_agent import NixlAgent, _rows, make_agent_name
    from tandem.kvtransfer.prepped_blocks import count_runs, sorted_block_pairs
    from tandem.kvtransfer.tp_plan import BlockGeometry, HeadRead, read_descriptors, shard_for

    geometry = BlockGeometry(BLOCKS_FIRST, 1, 1, 64, 4)  # 512 bytes per block
    shard = shard_for(1, 1, 0)
    whole = HeadRead(0, 0, 1)
    target, reader = (
        NixlAgent(make_agent_name("setup-p", 0)),
        NixlAgent(make_agent_name("setup-d", 0), prepped_reads=True),
    )
    kv_p = torch.zeros((NUM_BLOCKS, 128), device=device)
    kv_d = torch.zeros((NUM_BLOCKS, 128), device=device)
    p_region, d_region = target.register(kv_p), reader.register(kv_d)
    assert d_region.block_len == geometry.block_len(1)
    peer = reader.add_peer(target.metadata)
    agent, prepped = reader._agent, reader._prepped
    mem = d_region.mem_type
    out = {}
    for name, (local_ids, remote_ids) in SETUP_CASES.items():
        by_address, by_ids = [], []
        for _ in range(iters):
            t0 = time.perf_counter()
            descs = read_descriptors(
                geometry,
                shard,
                shard,
                whole,
                local_ids,
                remote_ids,
                d_region.base_addr,
                p_region.base_addr,
            )
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(_rows(descs.local_addrs, descs.lengths, 0), mem),
                agent.get_xfer_descs(_rows(descs.remote_addrs, descs.lengths, 0), mem),
                peer,
            )
            t1 = time.perf_counter()
            agent.release_xfer_handle(handle)
            t2 = time.perf_counter()
            local, remote = sorted_block_pairs(local_ids, remote_ids)
            handle = prepped.make_read(peer, p_region, local, remote)
            num_runs = count_runs(local, remote)
            t3 = time.perf_counter()
            agent.release_xfer_handle(handle)
            by_address.append(t1 - t0)
            by_ids.append(t3 - t2)
        assert num_runs == len(descs), (name, num_runs, len(descs))
        out[name] = (
            statistics.median(by_address) * 1e6,
            statistics.median(by_ids) * 1e6,
            num_runs,
        )
    reader.close()
    target.close()
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda[:N] (VRAM)")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--iters", type=int, default=8, help="timed transfers per size (at least 64 / MiB)"
    )
    parser.add_argument("--handoff-iters", type=int, default=200)
    parser.add_argument("--ucx-tls", default=None, help="set UCX_TLS for both processes")
    parser.add_argument("--progress-thread", action="store_true", help="NIXL progress threads on")
    parser.add_argument("--notify", default="side_channel", choices=["side_channel", "nixl"])
    parser.add_argument(
        "--prepped-lists",
        choices=["on", "off"],
        default="on",
        help="whole-block READs index block lists prepared once (nixl_prepped_reads, default on)",
    )
    args = parser.parse_args(argv)
    message = no_device_message(args.device)
    if message is not None:
        print(f"kv_transfer: {message}; nothing measured")
        return 0
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls

    import numpy as np
    import torch

    from tandem.wire.auth import generate_secret

    config = {
        "cluster_secret": generate_secret(),  # CURVE on the side channel, as served
        "model_name": "bench",
        "nixl_progress_thread": args.progress_thread,
        "notification_transport": args.notify,
        "nixl_prepped_reads": args.prepped_lists == "on",
    }
    rng = np.random.default_rng(SEED)
    pair = ReadPair(config, args.device)
    try:
        rows = [
            throughput_row(pair, size, rng, max(args.iters, 64 // size)) for size in args.sizes_mib
        ]
        p_lat, d_lat = handoff(pair, args.handoff_iters)
        ping_s = [pair.prefill.ping() for _ in range(args.handoff_iters)]
        block_kib = pair.block_bytes // 1024
    finally:
        pair.close()

    from tandem.kvtransfer.nixl_agent import nixl_version

    memory = "VRAM" if args.device.startswith("cuda") else "DRAM"
    print(
        f"\nKV transfer, 2 processes, NIXL {nixl_version()} UCX (UCX_TLS="
        f"{os.environ.get('UCX_TLS', 'default')}, progress thread "
        f"{'on' if args.progress_thread else 'off'}, notifications via {args.notify}, "
        f"{'prepped block lists' if args.prepped_lists == 'on' else 'lists prepared per READ'})\n"
        f"KV in {memory}: {device_name(args.device)}; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)"
    )
    print(
        f"blocks-first fp32 KV, {block_kib} KiB/block, fresh blocks per "
        f"transfer; medians over >= {args.iters} transfers after a warm-up\n"
    )
    threads = torch.get_num_threads()
    copies = (
        f"{'copy 1 thr':>11} {f'copy {threads} thr':>11}"
        if memory == "DRAM"
        else f"{'dev copy':>11} {'dev copy':>11}"
    )
    print(
        f"{'size':>8} {'blocks':>6} {'descs':>5} {'NIXL READ':>10} {'+connector':>11} "
        f"{copies} {'READ/best copy':>15}   (GB/s)"
    )
    for r in rows:
        print(
            f"{r['size']:>8} {r['blocks']:>6} {r['descs']:>5} {r['nixl']:>10.2f} "
            f"{r['wall']:>11.2f} {r['copy1']:>11.2f} {r['copyn']:>11.2f} {r['ratio']:>15.0%}"
        )
    print("\nREAD set-up, block ids -> READ handle (nothing transferred), median us:")
    print(f"{'load':>22} {'descs':>5} {'addresses (prep per READ)':>26} {'prepped lists':>14}")
    for name, (by_address_us, by_ids_us, num_descs) in setup_cost_us(args.device).items():
        print(f"{name:>22} {num_descs:>5} {by_address_us:>26.1f} {by_ids_us:>14.1f}")
    print(
        f"\nhandoff, 1-block request, {len(p_lat)} iterations after the first handshake:\n"
        f"  P params ready -> D read + P got 'done': p50 {pct(p_lat, 0.5) * 1e3:.2f} ms, "
        f"p99 {pct(p_lat, 0.99) * 1e3:.2f} ms\n"
        f"  D params in -> blocks filled (done_recving): p50 {pct(d_lat, 0.5) * 1e3:.2f} ms, "
        f"p99 {pct(d_lat, 0.99) * 1e3:.2f} ms\n"
        f"  for scale, a pipe round trip D->P->D: p50 {pct(ping_s, 0.5) * 1e3:.2f} ms, "
        f"p99 {pct(ping_s, 0.99) * 1e3:.2f} ms; load average {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
