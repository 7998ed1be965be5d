"""NIXL READ between two processes, KV in VRAM (issue #10): raw, through the
connector, and next to a device copy of the same bytes.

Run from the repository root::

    .venv/bin/python benchmarks/gpu_nixl.py                  # CUDA, 16 / 64 / 256 MiB
    .venv/bin/python benchmarks/gpu_nixl.py --device cpu     # the same code on DRAM

A prefill connector in a child process and a decode connector here
(``benchmarks/kv_read_pair.py``), fp32 KV of 512 KiB blocks (a bf16 block of
a Llama-3.2-1B shape), fresh blocks every READ in these layouts: ``contiguous``
(one run of blocks on each side: one descriptor) and ``fragmented`` (3 runs
on D, 4 on P, not in address order: up to 6 descriptors), ``scattered``
(blocks in random order on both sides: about one descriptor per block, what
a decode engine's READs post once the block pools churn; see
``benchmarks/kv_fragmentation.py``), plus ``concurrent``
(4 loads of a quarter each, one run each, started in one engine step: one
READ per load, timed from the first post to the last completion; does a
GPU hide a READ's fixed cost behind the others?). Per size and layout:

* raw READ: NIXL alone, the connector's descriptors posted through D's agent
  (one READ per load)
* connector READ: the load through both connector halves, from planning the
  descriptors to the READ seen done (the connector's own load record)
* device copy: one ``Tensor.copy_`` of as many bytes on the device (the
  ceiling the READs are held to, whatever their layout)

Every READ and copy lands in zeroed blocks and is compared byte for byte
with P's content (outside the timing). D checks a READ in flight back to
back (``--poll-us 0``, yielding the GIL), as the copy's synchronize waits.
The transport line is the connector's start-up probe (``kvtransfer/ucx/probe.py``) under the UCX
settings the connector filled in. Target (H100): connector READ >= 70% of
the device copy from 16 MiB, default settings. ``vram_read_rows()`` gives
the same as rows of ``benchmarks/gpu_engine.py``. Without CUDA the script
(default ``--device cuda``) says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.kv_read_pair import (  # noqa: E402
    BLOCK_SHAPE,
    NUM_BLOCKS,
    SEED,
    ReadPair,
    device_name,
    median_gbs,
    no_device_message,
    pick_blocks,
    sync,
    timed_copy_s,
)

MiB = 2**20
SIZES = (16 * MiB, 64 * MiB, 256 * MiB)
LAYOUTS = ("contiguous", "fragmented", "scattered", "concurrent")
CONCURRENT_LOADS = 4
TARGET_FROM_BYTES = 16 * MiB
TARGET_OF_COPY = 0.70


@dataclasses.dataclass
class ReadRow:
    """Medians of one (size, layout); GB/s = bytes moved / seconds."""

    num_bytes: int
    layout: str
    num_blocks: int
    num_descriptors: int  # what the connector posted (and the raw READ posts)
    raw_gbs: float
    connector_gbs: float
    copy_gbs: float
    num_checked: int  # READs and copies compared byte for byte

    @property
    def of_copy(self) -> float:
        return self.connector_gbs / self.copy_gbs

    @property
    def of_raw(self) -> float:
        return self.connector_gbs / self.raw_gbs

    @property
    def target(self) -> str:
        """ "met" / "MISSED" against the issue's target, "-" below its sizes."""
        if self.num_bytes < TARGET_FROM_BYTES:
            return "-"
        return "met" if self.of_copy >= TARGET_OF_COPY else "MISSED"


@dataclasses.dataclass
class ReadReport:
    device: str
    device_label: str
    rows: list[ReadRow]
    transport: object | None  # kvtransfer.ucx.proto_info.TransportReport
    ucx_settings: dict[str, str]
    prepped_reads: bool
    iters: int
    block_bytes: int


def block_layout(
    rng, layout: str, num_blocks: int, limit: int
) -> list[tuple[list[int], list[int]]]:
    """Fresh ``(D blocks, P blocks)`` of each load one READ step moves:
    one load of one run (``contiguous``), of 3 runs on D and 4 on P
    (``fragmented``) or of single blocks in random order (``scattered``), or
    ``CONCURRENT_LOADS`` loads (fewer for fewer blocks) of one run each,
    started in one step (``concurrent``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "concurrent":
        scattered = (num_blocks, num_blocks)  # a run per block, in random order
        runs = {"contiguous": (1, 1), "fragmented": (3, 4), "scattered": scattered}[layout]
        return [
            (
                pick_blocks(rng, num_blocks, runs[0], limit),
                pick_blocks(rng, num_blocks, runs[1], limit),
            )
        ]
    k = min(CONCURRENT_LOADS, num_blocks)
    sizes = [num_blocks // k + (j < num_blocks % k) for j in range(k)]

    def one_run_each() -> list[list[int]]:  # load j in a random slot, at a random place
        slot = limit // k
        places = rng.permutation(k)
        starts = [int(p) * slot + int(rng.integers(0, slot - n + 1)) for p, n in zip(places, sizes)]
        return [list(range(start, start + n)) for start, n in zip(starts, sizes)]

    return list(zip(one_run_each(), one_run_each()))


def _check(kv, block_ids, expected, remote_block_ids, what: str) -> None:
    import torch

    local = torch.tensor(block_ids, device=kv.device)
    remote = torch.tensor(remote_block_ids, device=kv.device)
    if not torch.equal(kv[local].view(torch.uint8), expected[remote].view(torch.uint8)):
        raise AssertionError(f"{what}: the blocks read differ from the prefill process's")


def _zero(kv, block_ids) -> None:
    import torch

    kv[torch.tensor(block_ids, device=kv.device)] = 0


def _measure_one(pair: ReadPair, expected, rng, num_bytes: int, layout: str, iters: int) -> ReadRow:
    num_blocks = max(1, num_bytes // pair.block_bytes)
    raw_s: list[float] = []
    connector_s: list[float] = []
    copy_s: list[float] = []
    descriptors: set[int] = set()
    checked = 0
    for i in range(iters + 1):  # the first one warms up
        loads = block_layout(rng, layout, num_blocks, pair.shape[0])
        local = [b for ids, _ in loads for b in ids]
        remote = [b for _, ids in loads for b in ids]
        rids = [f"{layout}-{num_bytes}-{i}-{k}" for k in range(len(loads))]
        _zero(pair.kv, local)
        params = [pair.finish(rid, p_ids) for rid, (_, p_ids) in zip(rids, loads)]
        pair.pull_many([(rid, par, d_ids) for rid, par, (d_ids, _) in zip(rids, params, loads)])
        records = pair.worker.drain_load_records()
        pair.worker.drain_transfer_seconds()
        for rid in rids:
            pair.prefill.wait_done_sending(rid)
        _check(pair.kv, local, expected, remote, "connector READ")
        num_descs = sum(r[3] for r in records)
        connector = max(r[5] for r in records) - min(r[4] for r in records)

        descs = [pair.descriptors(d_ids, p_ids) for d_ids, p_ids in loads]
        if sum(map(len, descs)) != num_descs or len(records) != len(loads):
            raise AssertionError(
                f"raw READs have {sum(map(len, descs))} descriptors, the connector's {num_descs}"
            )
        _zero(pair.kv, local)
        raw = pair.raw_read_s(*descs)
        _check(pair.kv, local, expected, remote, "raw READ")

        # the ceiling: one copy of as many bytes (a copy per scattered block
        # would time kernel launches on a GPU and torch calls on a CPU)
        span = list(range(num_blocks))
        src_span = list(range(pair.shape[0] - num_blocks, pair.shape[0]))
        _zero(pair.kv, span)
        copy = timed_copy_s(pair.kv, expected, span, src_span, pair.device)
        _check(pair.kv, span, expected, src_span, "device copy")
        checked += 3
        descriptors.add(num_descs)
        if i:
            raw_s.append(raw)
            connector_s.append(connector)
            copy_s.append(copy)
    moved = num_blocks * pair.block_bytes
    return ReadRow(
        moved,
        layout,
        num_blocks,
        max(descriptors),
        median_gbs(moved, raw_s),
        median_gbs(moved, connector_s),
        median_gbs(moved, copy_s),
        checked,
    )


def measure(
    device: str = "cuda",
    sizes_bytes: tuple[int, ...] | list[int] = SIZES,
    iters: int = 8,
    layouts: tuple[str, ...] | list[str] = LAYOUTS,
    block_shape: tuple[int, ...] = BLOCK_SHAPE,
    num_blocks: int = NUM_BLOCKS,
    probe: bool = True,
    prepped_reads: bool | None = None,
    poll_s: float = 0.0,
    prefill_poll_s: float = 0.0001,
) -> ReadReport:
    """Run the READs (see the module doc) on ``device``; ``probe`` also runs
    the UCX transport probe; ``prepped_reads`` None keeps the connector's
    default; D checks a READ in flight every ``poll_s`` (0: back to back,
    yielding the GIL, as a device copy's synchronize waits); P's loop calls
    into NIXL every ``prefill_poll_s`` (besides its progress poller, every
    1 ms while it holds blocks). Raises when any READ or copy is not
    byte-exact."""
    import numpy as np

    from tandem.kvtransfer.ucx.env import ucx_env_defaults
    from tandem.wire.auth import generate_secret

    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config: dict = {"model_name": "bench", "cluster_secret": generate_secret()}
    if prepped_reads is not None:
        config["nixl_prepped_reads"] = prepped_reads
    pair = ReadPair(
        config,
        device,
        num_blocks,
        block_shape,
        prefill_poll_interval_s=prefill_poll_s,
        poll_s=poll_s,
    )
    try:
        expected = pair.expected()
        params = pair.finish("warm-up", [0])  # handshake + first READ
        pair.pull("warm-up", params, [0])
        pair.prefill.wait_done_sending("warm-up")
        pair.worker.drain_load_records()
        pair.worker.drain_transfer_seconds()
        settings = {k: os.environ.get(k, "") for k in ucx_env_defaults(device)}
        transport = None
        if probe:
            from tandem.kvtransfer.ucx.probe import run_probe

            memory = "VRAM" if device.startswith("cuda") else "DRAM"
            index = pair.kv.device.index
            transport = run_probe(memory, index or 0)
        rng = np.random.default_rng(SEED)
        rows = [
            _measure_one(pair, expected, rng, size, layout, iters)
            for size in sizes_bytes
            for layout in layouts
        ]
        sync(device)
        prepped = pair.worker.agent.uses_prepped_lists
        return ReadReport(
            device, device_name(device), rows, transport, settings, prepped, iters, pair.block_bytes
        )
    finally:
        pair.close()


def _size(num_bytes: int) -> str:
    return f"{num_bytes / MiB:g} MiB" if num_bytes >= MiB else f"{num_bytes // 1024} KiB"


def transport_text(report: ReadReport) -> tuple[str, str]:
    """``(transport, warning)`` of the probe, or why there is none."""
    t = report.transport
    if t is None:
        return "not probed", ""
    return f"{t.transport} ({t.path or 'no path'})", t.warning


def format_table(report: ReadReport) -> str:
    from tandem.kvtransfer.nixl_agent import nixl_version

    memory = "VRAM" if report.device.startswith("cuda") else "DRAM"
    transport, warning = transport_text(report)
    settings = ", ".join(f"{k}={v or '(unset)'}" for k, v in report.ucx_settings.items())
    lines = [
        f"NIXL READ between two processes, KV in {memory}: {report.device_label}",
        f"NIXL {nixl_version()}, {datetime.date.today().isoformat()}, load average "
        f"{os.getloadavg()[0]:.1f}; UCX settings: {settings}; connector READs from "
        f"{'prepared block lists' if report.prepped_reads else 'descriptors prepared per READ'}",
        f"UCX transport of a READ (probe): {transport}"
        + (f"  WARNING: {warning}" if warning else ""),
        f"fp32 KV, {report.block_bytes // 1024} KiB blocks, fresh blocks per READ; medians of "
        f"{report.iters} READs after a warm-up; each READ and copy checked byte for byte",
        f"target: connector READ >= {TARGET_OF_COPY:.0%} of the device copy from "
        f"{_size(TARGET_FROM_BYTES)}",
        "",
        f"{'size':>8} {'layout':>10} {'blocks':>6} {'descs':>5} {'raw READ':>9} "
        f"{'connector':>9} {'conn/raw':>8} {'dev copy':>9} {'conn/copy':>9} {'target':>6}  (GB/s)",
    ]
    for r in report.rows:
        lines.append(
            f"{_size(r.num_bytes):>8} {r.layout:>10} {r.num_blocks:>6} {r.num_descriptors:>5} "
            f"{r.raw_gbs:>9.2f} {r.connector_gbs:>9.2f} {r.of_raw:>8.0%} {r.copy_gbs:>9.2f} "
            f"{r.of_copy:>9.0%} {r.target:>6}"
        )
    return "\n".join(lines)


def vram_read_rows() -> list[tuple[str, str, str]]:
    """Rows ``(measure, value, note)`` for ``benchmarks/gpu_engine.py``."""
    message = no_device_message("cuda")
    if message is not None:
        return [("NIXL VRAM READ", "not measured", message)]
    report = measure("cuda")
    transport, warning = transport_text(report)
    rows = [("NIXL VRAM transport (UCX probe)", transport, warning)]
    for r in report.rows:
        rows.append(
            (
                f"NIXL VRAM READ {_size(r.num_bytes)} {r.layout}: raw / connector / copy",
                f"{r.raw_gbs:.0f} / {r.connector_gbs:.0f} / {r.copy_gbs:.0f} GB/s",
                f"connector {r.of_copy:.0%} of the copy (target >= {TARGET_OF_COPY:.0%}: "
                f"{r.target}); {r.num_descriptors} descriptors",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda[:N] (VRAM) or cpu (DRAM)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[s / MiB for s in SIZES])
    parser.add_argument("--iters", type=int, default=8, help="timed READs per size and layout")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--no-probe", action="store_true", help="skip the UCX transport probe")
    parser.add_argument(
        "--prepped-lists",
        choices=["default", "on", "off"],
        default="default",
        help="the connector's nixl_prepped_reads (default: its default)",
    )
    parser.add_argument(
        "--poll-us", type=float, default=0.0, help="D's wait between checks of a READ in flight"
    )
    parser.add_argument(
        "--prefill-poll-us",
        type=float,
        default=100.0,
        help="how often P's loop calls into NIXL (its progress poller adds every 1 ms)",
    )
    args = parser.parse_args(argv)
    message = no_device_message(args.device)
    if message is not None:
        print(f"gpu_nixl: {message}; nothing measured")
        return 0
    report = measure(
        args.device,
        [int(s * MiB) for s in args.sizes_mib],
        args.iters,
        args.layouts,
        probe=not args.no_probe,
        prepped_reads={"default": None, "on": True, "off": False}[args.prepped_lists],
        poll_s=args.poll_us * 1e-6,
        prefill_poll_s=args.prefill_poll_us * 1e-6,
    )
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
