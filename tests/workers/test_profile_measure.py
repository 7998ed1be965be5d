"""tandem profile: times the real in-process engine (tiny) and writes a
profile the simulator loads. No timed assertions: only the shape."""

from __future__ import annotations

import json

from tandem.cluster.cli.main import main
from tandem.cluster.planner.contention import HostShare
from tandem.cluster.planner.measure import measure
from tandem.cluster.planner.profile import load_profile
from tandem.cluster.planner.simulator import SimRequest, Simulator


def test_measure_tiny_gives_a_profile_the_simulator_runs():
    p = measure(
        "tiny", repeats=1, prefill_tokens=[16, 64], batch_sizes=[1, 2], context_tokens=[32, 64]
    )
    assert p.prefill_tokens == [16, 64] and len(p.prefill_time_s) == 2
    assert [len(r) for r in p.decode_time_s] == [2, 2]
    assert all(t > 0 for t in p.prefill_time_s + [x for r in p.decode_time_s for x in r])
    assert p.transfer.kv_bytes_per_token > 0
    assert p.meta["model"] == "tiny"
    assert p.scheduler["max_model_len"] >= 64
    recs = Simulator(p, 1, 1).run([SimRequest(0.0, list(range(40)), 3)])
    assert len(recs[0].token_times) == 3


def test_profile_command_writes_json(tmp_path, monkeypatch, capsys):
    import tandem.cluster.planner.measure as m

    # the command's own grid takes ~1 min: a small one here, the same code path
    monkeypatch.setattr(m, "PREFILL_TOKENS", [16])
    monkeypatch.setattr(m, "DECODE_BATCH_SIZES", [1])
    monkeypatch.setattr(m, "DECODE_CONTEXT_TOKENS", [32])
    out = tmp_path / "tiny.json"
    assert main(["profile", "--out", str(out), "--repeats", "1", "--transfer-latency-ms", "3"]) == 0
    assert json.loads(out.read_text())["format"] == "tandem-profile/1"
    assert load_profile(str(out)).transfer.latency_s == 0.003
    # the served engine's settings: its limits land in the profile's scheduler
    args = ["profile", "--out", str(out), "--repeats", "1", "--torch-threads", "1"]
    assert main([*args, "--num-kv-blocks", "300", "--max-num-seqs", "7"]) == 0
    prof = load_profile(str(out))
    assert (prof.scheduler["num_kv_blocks"], prof.scheduler["max_num_seqs"]) == (300, 7)
    assert prof.tp_size == 1
    assert prof.host is None  # a device per engine unless told otherwise
    # engines sharing a CPU box: the cores given, the engine's own torch threads
    assert main([*args, "--shared-cores", "2"]) == 0
    assert load_profile(str(out)).host == HostShare(cores=2.0, engine_threads=1)
    assert main([*args, "--shared-cores", "0"]) == 2
    assert "--shared-cores" in capsys.readouterr().err
    assert main([*args, "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs" in capsys.readouterr().err
    assert main(["profile", "--out", str(out), "--transfer-bytes-per-s", "0"]) == 2
    assert "--transfer-bytes-per-s" in capsys.readouterr().err


def test_profile_command_grid_device_and_dtype(tmp_path, capsys):
    out = tmp_path / "grid.json"
    grid = [
        "--prefill-tokens",
        "16,48",
        "--decode-batch-sizes",
        "1,3",
        "--decode-context-tokens",
        "24",
    ]
    args = ["profile", "--out", str(out), "--repeats", "1", "--device", "cpu", "--dtype", "float32"]
    assert main([*args, *grid]) == 0
    prof = load_profile(str(out))
    assert prof.prefill_tokens == [16, 48]
    assert (prof.decode_batch_sizes, prof.decode_context_tokens) == ([1, 3], [24])
    assert prof.meta["device"] == "cpu"
    assert prof.transfer.kv_bytes_per_token % 4 == 0  # float32 KV
    for bad in ("16,x", "48,16", "0,16", ","):
        assert main([*args, "--prefill-tokens", bad]) == 2
        assert "--prefill-tokens" in capsys.readouterr().err
