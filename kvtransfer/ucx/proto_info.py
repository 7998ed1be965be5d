"""Which transport UCX picked for a READ, from its ``UCX_PROTO_INFO=y`` tables.

With ``UCX_PROTO_INFO=y`` UCX prints, for every endpoint configuration and
operation, the protocol it selected per message size range (on stdout,
each line behind a ``[time] [host:pid:thread]`` prefix)::

    +--------+--------------------+----------------------------+
    | D-probe intra-node cfg#1                                 |   worker, scope
    | remote memory read by ucp_get*(multi) into cuda/GPU0 ... |   operation
    +--------+--------------------+----------------------------+
    | Range  |    Description     |           Config           |
    +--------+--------------------+----------------------------+
    | 0..inf | zero-copy          | cuda_ipc/cuda              |   rows
    +--------+--------------------+----------------------------+

``parse_proto_info`` turns the text into ``ProtoTable``s;
``transport_report`` (pure) decides what a KV READ of a memory type uses:
the transport of the row that covers large messages, whether any row goes
over TCP, and whether UCX emulates the READ in software (two-sided: the
target must progress, bytes staged through host memory). A VRAM READ over
TCP or emulated is the slow fallback of issue #10: it gets a warning.
"""

from __future__ import annotations

import re

import msgspec

_PREFIX = re.compile(r"^\s*(?:\[[^\]]*\]\s*)*")
_TITLE = re.compile(r"^(?P<worker>.*?)\s+(?P<scope>\S+)\s+cfg#\d+$")
_LANE = re.compile(r"([A-Za-z0-9_]+)/(\S+)")
_HEADER = ["Range", "Description", "Config"]


class ProtoTable(msgspec.Struct, frozen=True):
    worker: str  # UCX worker name (NIXL names it after the agent)
    scope: str  # "self", "intra-node", ... (the endpoint's reach)
    operation: str  # "remote memory read by ucp_get*(multi) into host memory from host"
    rows: list[tuple[str, str, str]]  # (range, description, config)


class TransportReport(msgspec.Struct, frozen=True):
    memory: str  # "DRAM" | "VRAM": what the probe registered
    scope: str  # reach of the probed endpoint ("intra-node": two processes, one host)
    transport: str  # transport/device of large READs, e.g. "cuda_ipc/cuda"; "unknown"
    path: str  # UCX's description: "zero-copy", "software emulation", ...
    over_tcp: bool  # some READ size goes over TCP
    emulated: bool  # large READs are emulated in software (P must progress)
    warning: str = ""  # non-empty: the slow fallback, log it and raise the metric


def _cells(line: str) -> list[str] | None:
    body = _PREFIX.sub("", line).strip()
    if not body.startswith("|"):
        return None
    return [cell.strip() for cell in body.strip("|").split("|")]


def _is_border(line: str) -> bool:
    return _PREFIX.sub("", line).strip().startswith("+-")


def parse_proto_info(text: str) -> list[ProtoTable]:
    """Every complete table in ``text`` (other lines are ignored)."""
    blocks: list[list[list[str]]] = []  # runs of content rows between borders
    current: list[list[str]] | None = None
    for line in text.splitlines():
        if _is_border(line):
            if current:
                blocks.append(current)
            current = []
            continue
        cells = _cells(line)
        if cells is None:
            if current:
                blocks.append(current)
            current = None
        elif current is not None:
            current.append(cells)
    tables = []
    for i in range(len(blocks) - 2):
        title, header, rows = blocks[i : i + 3]
        if any(len(r) != 1 for r in title) or header != [_HEADER]:
            continue
        if not rows or any(len(r) != 3 for r in rows):
            continue
        match = _TITLE.match(title[0][0])
        if match is None:
            continue
        tables.append(
            ProtoTable(
                worker=match["worker"],
                scope=match["scope"],
                operation=" ".join(r[0] for r in title[1:]),
                rows=[(r[0], r[1], r[2]) for r in rows],
            )
        )
    return tables


def _lanes(config: str) -> list[str]:
    """``transport/device`` of each lane of a Config cell (multi-lane cells
    read like "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1")."""
    return [f"{tl}/{dev}" for tl, dev in _LANE.findall(config)]


def transport_report(tables: list[ProtoTable], memory: str, worker: str = "") -> TransportReport:
    """What a READ into ``memory`` ("DRAM" or "VRAM") from a peer uses,
    per the tables of ``worker`` (all workers when empty or absent)."""
    reads = [
        t for t in tables if t.operation.startswith("remote memory read") and t.scope != "self"
    ]
    mine = [t for t in reads if t.worker == worker]
    reads = mine or reads
    wanted = "cuda" if memory == "VRAM" else "host"
    reads = [t for t in reads if f"into {wanted}" in t.operation] or reads
    if not reads:
        return TransportReport(memory, "", "unknown", "", False, False, "")
    table = reads[-1]
    large = next((r for r in table.rows if r[0].endswith("inf")), table.rows[-1])
    lanes = _lanes(large[2])
    transport = " + ".join(lanes) or large[2] or "unknown"
    over_tcp = any(lane.startswith("tcp/") for r in table.rows for lane in _lanes(r[2]))
    emulated = "emulation" in large[1]
    warning = ""
    if memory == "VRAM" and (over_tcp or emulated):
        warning = (
            f"VRAM KV READs between processes of this node use {transport} ({large[1]}), "
            "not CUDA IPC or RDMA: expect well under 1 GB/s. Check that "
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY is not off and that UCX_TLS (if set) "
            "includes cuda_ipc (and rc/dc for other nodes)"
        )
    return TransportReport(memory, table.scope, transport, large[1], over_tcp, emulated, warning)


def stats_fields(report: TransportReport | None) -> dict[str, object]:
    """The ``KVTransferStats`` fields (scheduler/engine_stats.py) of a report;
    none before the probe has run."""
    if report is None:
        return {}
    return {
        "transport": report.transport,
        "transport_path": report.path,
        "transport_memory": report.memory,
        "transport_slow": report.memory == "VRAM" and (report.over_tcp or report.emulated),
    }
