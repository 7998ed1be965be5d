"""Trace replay (cluster/cli/trace_replay.py): formats, prompt synthesis, the
synthetic generator and its oracle."""

import json

import pytest

from tandem.cluster.cli.trace_replay import (
    SynthConfig,
    load_trace,
    oracle_hit_tokens,
    synthesize,
    synthesize_prompt,
    trace_workload,
)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_equal_hash_ids_give_equal_blocks(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 9, "output_length": 2, "hash_ids": [7, 8, 5]},
        {"timestamp": 3000, "input_length": 5, "output_length": 1, "hash_ids": [6]},
    ]
    prompts, outs, offsets = trace_workload(
        _write_jsonl(tmp_path / "t.jsonl", rows), 1000, 0, 0.5, 4
    )
    assert [len(p) for p in prompts] == [10, 9, 5]
    assert prompts[0][:8] == prompts[1][:8] and prompts[0][8:] != prompts[1][8:10]
    assert prompts[2][:4] != prompts[0][:4]
    assert outs == [3, 2, 1]
    assert offsets == [0.0, 0.25, 1.0]  # ms -> s, from 0, x time_scale
    assert all(0 <= t < 1000 for p in prompts for t in p)
    again, _, _ = trace_workload(str(tmp_path / "t.jsonl"), 1000, 0, 1.0, 4)
    assert again == prompts  # seeded


def test_azure_csv(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:47.1805900,20,4\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
    )
    rows = load_trace(str(path))
    assert [(r.input_length, r.output_length, r.hash_ids) for r in rows] == [
        (374, 44, []),
        (20, 4, []),
    ]
    assert rows[0].timestamp_s == 0.0 and rows[1].timestamp_s == pytest.approx(0.5)
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_trace(str(path))
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,4\n")
    with pytest.raises(ValueError, match=":2: bad TIMESTAMP"):
        load_trace(str(path))


@pytest.mark.parametrize(
    "row, message",
    [
        ({"timestamp": 0, "input_length": 0, "output_length": 1}, "input_length"),
        ({"timestamp": 0, "input_length": 3, "output_length": "x"}, "output_length"),
        ({"timestamp": -1, "input_length": 3, "output_length": 1}, "timestamp"),
        ({"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1.5]}, "hash_ids"),
    ],
)
def test_bad_mooncake_rows_name_the_field(tmp_path, row, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=f"bad.jsonl:1: {message}"):
        load_trace(path)
    with pytest.raises(ValueError, match="time-scale"):
        trace_workload(path, 100, 0, 0.0, 4)


def test_synthetic_trace_shapes_and_oracle():
    cfg = SynthConfig(num_sessions=10, block_tokens=8, seed=3)
    rows = synthesize(cfg)
    assert rows == synthesize(cfg)  # seeded
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert len(rows) >= 2 * cfg.num_sessions
    # multi-turn: most requests extend an earlier request's blocks
    earlier = set()
    num_extend = 0
    for r in rows:
        ids = tuple(r["hash_ids"])
        num_extend += any(ids[:n] in earlier for n in range(len(ids) - 1, 0, -1))
        earlier.update(ids[:n] for n in range(1, len(ids) + 1))
        assert r["input_length"] == len(ids) * cfg.block_tokens
    assert num_extend >= len(rows) // 2
    hit = oracle_hit_tokens(rows, cfg.block_tokens)
    total = sum(r["input_length"] for r in rows)
    assert 0.3 < hit / total < 1.0
    plain = synthesize(SynthConfig(num_sessions=10, block_tokens=8, seed=3, share_prefixes=False))
    assert oracle_hit_tokens(plain, 8) == 0
    ids = [h for r in plain for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))


def test_synthesized_prompts_share_exactly_the_shared_blocks():
    rows = synthesize(SynthConfig(num_sessions=4, block_tokens=4, seed=1))
    from tandem.cluster.cli.trace_replay import TraceRequest

    reqs = [TraceRequest(0, r["input_length"], 1, r["hash_ids"]) for r in rows]
    prompts = [synthesize_prompt(r, i, 50000, 0, 4) for i, r in enumerate(reqs)]
    for a in range(len(rows)):
        for b in range(a):
            common = 0
            for x, y in zip(rows[a]["hash_ids"], rows[b]["hash_ids"]):
                if x != y:
                    break
                common += 1
            assert prompts[a][: common * 4] == prompts[b][: common * 4]
            if common < min(len(rows[a]["hash_ids"]), len(rows[b]["hash_ids"])):
                lo, hi = common * 4, common * 4 + 4
                assert prompts[a][lo:hi] != prompts[b][lo:hi]


def test_trace_flags_are_one_definition_for_bench_simulate_and_plan():
    """``add_trace_arguments`` registers them for every command that replays a trace."""
    import argparse

    from tandem.cluster.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))

    def flags(command: str) -> list[tuple]:
        return [
            (a.option_strings, a.default, a.type, a.help)
            for a in sub.choices[command]._actions
            if a.dest in ("trace", "time_scale", "trace_block_tokens")
        ]

    assert len(flags("bench")) == 3
    assert flags("bench") == flags("simulate") == flags("plan")
