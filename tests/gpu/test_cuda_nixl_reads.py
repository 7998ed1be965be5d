"""benchmarks/gpu_nixl.py's READs with the KV caches in VRAM, both connector
READ paths (prepared block lists, the default, and descriptors prepared per
READ): every raw READ, connector READ and device copy byte-exact, one
descriptor per run. Skipped without CUDA (tests/conftest.py); the DRAM run of
the same functions is tests/unit/test_gpu_nixl_benchmark.py."""

from __future__ import annotations

import pytest

from benchmarks import gpu_nixl

pytestmark = pytest.mark.gpu

KiB = 1024


@pytest.mark.parametrize("prepped", [True, False])
def test_vram_reads_are_byte_exact_on_both_read_paths(prepped):
    report = gpu_nixl.measure(
        "cuda",
        sizes_bytes=[64 * KiB, 1024 * KiB],
        iters=2,
        block_shape=(2, 2, 4, 2, 16),  # fp32: 2 KiB per block
        num_blocks=1024,
        probe=False,
        prepped_reads=prepped,
    )
    assert report.prepped_reads is prepped
    assert "KV in VRAM" in gpu_nixl.format_table(report)
    for row in report.rows:
        assert row.num_checked == 9  # measure() raises on any byte that differs
        assert min(row.raw_gbs, row.connector_gbs, row.copy_gbs) > 0
        if row.layout == "contiguous":
            assert row.num_descriptors == 1
        elif row.layout == "concurrent":  # 4 loads of one run each
            assert row.num_descriptors == 4
        elif row.layout == "scattered":  # single blocks in random order
            assert row.num_descriptors >= row.num_blocks // 4
        else:
            assert 4 <= row.num_descriptors <= 6
