"""benchmarks/gpu_nixl.py: the functions the GPU run uses, run on DRAM (two
processes, real NIXL over UCX loopback, every READ and copy byte-checked),
and the no-GPU exits of it and of benchmarks/kv_transfer.py."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gpu_nixl, kv_transfer
from benchmarks.kv_read_pair import pick_blocks

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: it measures")

KiB = 1024
SMALL_BLOCK = (2, 2, 4, 2, 16)  # fp32: 2 KiB per block


@pytest.mark.slow
def test_cpu_path_reads_byte_exact_through_raw_nixl_the_connector_and_a_copy():
    report = gpu_nixl.measure(
        "cpu",
        sizes_bytes=[8 * KiB, 32 * KiB],
        iters=2,
        block_shape=SMALL_BLOCK,
        num_blocks=64,
        probe=False,
    )
    assert [(r.num_bytes, r.layout) for r in report.rows] == [
        (size, layout) for size in (8 * KiB, 32 * KiB) for layout in gpu_nixl.LAYOUTS
    ]
    for row in report.rows:
        assert row.num_blocks == row.num_bytes // (2 * KiB)
        # measure() raises unless each READ and copy landed byte-exact: 3 per iteration + warm-up
        assert row.num_checked == 3 * 3
        assert min(row.raw_gbs, row.connector_gbs, row.copy_gbs) > 0
        assert row.target == "-"  # below 16 MiB the issue sets no target
    by_layout = {(r.num_bytes, r.layout): r.num_descriptors for r in report.rows}
    assert by_layout[8 * KiB, "contiguous"] == by_layout[32 * KiB, "contiguous"] == 1
    # 3 runs on D x 4 on P: between 4 and 6 descriptors, never one per block
    assert 4 <= by_layout[32 * KiB, "fragmented"] <= 6
    # single blocks in random order: mostly one descriptor per block
    assert by_layout[32 * KiB, "scattered"] >= 8
    # 4 loads of one run each, posted in one step: one descriptor each
    assert by_layout[8 * KiB, "concurrent"] == by_layout[32 * KiB, "concurrent"] == 4
    table = gpu_nixl.format_table(report)
    assert "KV in DRAM" in table and "not probed" in table


def test_block_layouts_are_distinct_blocks_in_the_named_number_of_runs():
    import numpy as np

    def num_runs(ids: list[int]) -> int:
        return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))

    rng = np.random.default_rng(0)
    for _ in range(20):
        ((local, remote),) = gpu_nixl.block_layout(rng, "fragmented", 24, 64)
        assert len(set(local)) == len(set(remote)) == 24
        assert max(local + remote) < 64
        assert num_runs(local) <= 3 and num_runs(remote) <= 4
        ((local, remote),) = gpu_nixl.block_layout(rng, "contiguous", 24, 64)
        assert num_runs(local) == num_runs(remote) == 1
        ((local, remote),) = gpu_nixl.block_layout(rng, "scattered", 24, 64)
        assert len(set(local)) == len(set(remote)) == 24 and max(local + remote) < 64
        for n, sizes in ((24, [6, 6, 6, 6]), (6, [2, 2, 1, 1]), (2, [1, 1])):
            loads = gpu_nixl.block_layout(rng, "concurrent", n, 64)
            assert [(len(d), len(p)) for d, p in loads] == [(s, s) for s in sizes]
            assert all(num_runs(d) == num_runs(p) == 1 for d, p in loads)
            assert len({b for d, _ in loads for b in d}) == n
            assert len({b for _, p in loads for b in p}) == n
            assert max(b for d, p in loads for b in d + p) < 64
    assert pick_blocks(rng, 5, 1, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="layout"):
        gpu_nixl.block_layout(rng, "striped", 4, 8)


@no_cuda
def test_without_cuda_the_vram_rows_and_scripts_say_so(capsys):
    assert gpu_nixl.vram_read_rows() == [
        ("NIXL VRAM READ", "not measured", "no GPU (torch.cuda.is_available() is False)")
    ]
    assert gpu_nixl.main([]) == 0
    assert kv_transfer.main(["--device", "cuda"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gpu_nixl: no GPU (torch.cuda.is_available() is False); nothing measured",
        "kv_transfer: no GPU (torch.cuda.is_available() is False); nothing measured",
    ]
