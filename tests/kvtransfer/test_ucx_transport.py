"""UCX settings and the transport report (kvtransfer/ucx/).

The CPU tables below were printed by this machine's UCX (1.23, bundled with
NIXL) with ``UCX_PROTO_INFO=y``; the GPU ones are written in the same format
for the cases of issue #10 (an H100 without NVLink: TCP by default, CUDA IPC
with get zero-copy on; RDMA between nodes; staging through shared memory).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tandem.kvtransfer import KVTransferConfig, create_connector
from tandem.kvtransfer.ucx.env import apply_ucx_env, ucx_env_defaults
from tandem.kvtransfer.ucx.proto_info import parse_proto_info, stats_fields, transport_report

CPU_CMA = """\
[1795455843.494600] [vm:30477:0]   +----------+--------------------+-------------------------+
[1795455843.499868] [vm:30477:0]   +--------+-------------+-------------------------------------------+
[1795455843.499868] [vm:30477:0]   | B intra-node cfg#1                                               |
[1795455843.499868] [vm:30477:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795455843.499868] [vm:30477:0]   +--------+-------------+-------------------------------------------+
[1795455843.499868] [vm:30477:0]   | Range  | Description |                  Config                   |
[1795455843.499868] [vm:30477:0]   +--------+-------------+-------------------------------------------+
[1795455843.499868] [vm:30477:0]   | 0..inf | zero-copy   | cma/memory                                |
[1795455843.499868] [vm:30477:0]   +--------+-------------+-------------------------------------------+
2026-11-23 17:44:03 NIXL INFO    _api.py:281 Initialized NIXL agent: B
[1795455843.513907] [vm:30477:0]   +--------+-------------+-----------------------------------+
[1795455843.513907] [vm:30477:0]   | A intra-node cfg#1                                       |
[1795455843.513907] [vm:30477:0]   | remote memory write by ucp_put* from host memory to host |
[1795455843.513907] [vm:30477:0]   +--------+-------------+-----------------------------------+
[1795455843.513907] [vm:30477:0]   | Range  | Description |              Config               |
[1795455843.513907] [vm:30477:0]   +--------+-------------+-----------------------------------+
[1795455843.513907] [vm:30477:0]   | 0..inf | zero-copy   | cma/memory                        |
[1795455843.513907] [vm:30477:0]   +--------+-------------+-----------------------------------+
"""

CPU_TCP = """\
[1795456315.664544] [vm:7506 :0]   +--------+--------------------+------------------------------------+
[1795456315.664544] [vm:7506 :0]   | B intra-node cfg#1                                               |
[1795456315.664544] [vm:7506 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795456315.664544] [vm:7506 :0]   +--------+--------------------+------------------------------------+
[1795456315.664544] [vm:7506 :0]   | Range  |    Description     |               Config               |
[1795456315.664544] [vm:7506 :0]   +--------+--------------------+------------------------------------+
[1795456315.664544] [vm:7506 :0]   | 0..inf | software emulation | tcp/lo                             |
[1795456315.664544] [vm:7506 :0]   +--------+--------------------+------------------------------------+
"""


def gpu_table(worker: str, scope: str, rows: list[tuple[str, str, str]]) -> str:
    """A read table as UCX prints it for cuda memory."""
    border = "[1.0] [gpu:1:0]   +--------+--------------------+--------------------------+"
    out = [
        border,
        f"[1.0] [gpu:1:0]   | {worker} {scope} cfg#2                                       |",
        "[1.0] [gpu:1:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |",
        border,
        "[1.0] [gpu:1:0]   | Range  | Description        | Config                   |",
        border,
        *(f"[1.0] [gpu:1:0]   | {r} | {d} | {c} |" for r, d, c in rows),
        border,
    ]
    return "\n".join(out) + "\n"


GPU_DEFAULT_TCP = gpu_table("D", "intra-node", [("0..inf", "software emulation", "tcp/lo")])
GPU_CUDA_IPC = gpu_table("D", "intra-node", [("0..inf", "zero-copy", "cuda_ipc/cuda")])
GPU_RDMA = gpu_table(
    "D",
    "inter-node",
    [
        ("0..8192", "short", "rc_mlx5/mlx5_0:1"),
        ("8193..inf", "zero-copy", "50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1"),
    ],
)
GPU_SYSV = gpu_table("D", "intra-node", [("0..inf", "software emulation", "sysv/memory")])


def test_cpu_tables_parse_and_report_the_real_transports():
    tables = parse_proto_info(CPU_CMA)
    assert [(t.worker, t.scope, t.operation.split(" by ")[0]) for t in tables] == [
        ("B", "intra-node", "remote memory read"),
        ("A", "intra-node", "remote memory write"),
    ]
    cma = transport_report(tables, "DRAM", worker="B")
    assert (cma.transport, cma.path, cma.over_tcp, cma.emulated, cma.warning) == (
        "cma/memory",
        "zero-copy",
        False,
        False,
        "",
    )
    tcp = transport_report(parse_proto_info(CPU_TCP), "DRAM", worker="B")
    assert (tcp.transport, tcp.path, tcp.over_tcp, tcp.emulated) == (
        "tcp/lo",
        "software emulation",
        True,
        True,
    )
    assert tcp.warning == ""  # DRAM over TCP works (the progress poller serves it)


@pytest.mark.parametrize(
    "text, transport, slow",
    [
        (GPU_DEFAULT_TCP, "tcp/lo", True),
        (GPU_CUDA_IPC, "cuda_ipc/cuda", False),
        (GPU_RDMA, "rc_mlx5/mlx5_0:1 + rc_mlx5/mlx5_1:1", False),
        (GPU_SYSV, "sysv/memory", True),
    ],
)
def test_gpu_cases(text, transport, slow):
    report = transport_report(parse_proto_info(text), "VRAM", worker="D")
    assert report.transport == transport
    assert bool(report.warning) is slow
    assert stats_fields(report) == {
        "transport": transport,
        "transport_path": report.path,
        "transport_memory": "VRAM",
        "transport_slow": slow,
    }
    if slow:
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in report.warning


def test_the_readers_table_wins_and_no_table_is_unknown():
    both = (
        gpu_table("P", "intra-node", [("0..inf", "zero-copy", "cuda_ipc/cuda")]) + GPU_DEFAULT_TCP
    )
    assert transport_report(parse_proto_info(both), "VRAM", worker="D").transport == "tcp/lo"
    assert transport_report(parse_proto_info(both), "VRAM", worker="P").transport == "cuda_ipc/cuda"
    nothing = transport_report(parse_proto_info("no tables here\n"), "DRAM")
    assert (nothing.transport, nothing.warning) == ("unknown", "")
    assert stats_fields(None) == {}


def test_env_fills_gaps_and_keeps_the_operators_values():
    env = {"UCX_RCACHE_MAX_UNRELEASED": "64"}
    applied, kept = apply_ucx_env("cuda:1", env)
    assert applied == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert kept == {"UCX_RCACHE_MAX_UNRELEASED": "64"}
    assert env == {"UCX_RCACHE_MAX_UNRELEASED": "64", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert ucx_env_defaults("cpu") == {"UCX_RCACHE_MAX_UNRELEASED": "1024"}
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}  # the operator said no
    assert apply_ucx_env("cuda", env)[0] == {"UCX_RCACHE_MAX_UNRELEASED": "1024"}
    assert env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"


@pytest.mark.parametrize(
    "kwargs, field",
    [({"device": "tpu"}, "device"), ({"transport_probe": "maybe"}, "transport_probe")],
)
def test_config_names_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=rf"KVTransferConfig\.{field}"):
        KVTransferConfig(**kwargs)


def test_probe_defaults_on_only_with_cuda():
    assert not KVTransferConfig().runs_transport_probe
    assert KVTransferConfig(device="cuda:0").runs_transport_probe
    assert KVTransferConfig(transport_probe="on").runs_transport_probe
    assert not KVTransferConfig(device="cuda", transport_probe="off").runs_transport_probe


@pytest.mark.slow
def test_cpu_connector_reports_its_real_transport(caplog):
    """A connector with the probe on registers DRAM; the probe's two
    processes READ over this host's UCX (cma) and the report is logged and
    exposed as stats fields."""
    _, worker = create_connector(
        KVTransferConfig(role="decode", engine_id="probe-d", transport_probe="on", block_size=4)
    )
    try:
        with caplog.at_level(logging.INFO, logger="tandem.kvtransfer.ucx.probe"):
            worker.register_kv_caches(torch.zeros((8, 2, 2, 4, 2, 8)))
            report = worker._transport_probe.wait(120.0)
        assert report is not None and report == worker.transport_report()
        assert (report.memory, report.scope, report.transport, report.path) == (
            "DRAM",
            "intra-node",
            "cma/memory",
            "zero-copy",
        )
        assert "KV transport of engine probe-d (DRAM, intra-node): cma/memory" in caplog.text
    finally:
        worker.shutdown()


def test_metrics_expose_the_transport_and_the_slow_fallback():
    from tandem.cluster.gateway.backend import EngineMetrics
    from tandem.cluster.observability.metrics import _kv_families
    from tandem.scheduler.engine_stats import EngineStats, KVTransferStats

    report = transport_report(parse_proto_info(GPU_DEFAULT_TCP), "VRAM", worker="D")
    engines = [
        EngineMetrics(EngineStats("decode-0", "decode", 1, kv_transfer=KVTransferStats())),
        EngineMetrics(
            EngineStats(
                "decode-1", "decode", 1, kv_transfer=KVTransferStats(**stats_fields(report))
            )
        ),
    ]
    families = {f.name: f for f in _kv_families(engines)}
    (info,) = families["tandem:kv_transport_info"].samples
    assert info.labels == {
        "engine": "decode-1",
        "role": "decode",
        "transport": "tcp/lo",
        "path": "software emulation",
        "memory": "VRAM",
    }
    (slow,) = families["tandem:kv_transport_slow"].samples
    assert (slow.labels["engine"], slow.value) == ("decode-1", 1.0)
