"""Graph memory measured on a GPU shared with another engine (``--num-gpus-per-engine 0.5``,
both starting together), with torch.cuda's memory queries faked (no GPU here): another
process allocating its KV cache during this engine's capture must not count as this engine's
graph memory (it would come out of this engine's KV budget), while the driver's memory
outside torch's allocator still does."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.graphs import runner

GIB = 2**30


class FakeDevice:
    """Device-wide free memory and this process's torch reservation."""

    def __init__(self) -> None:
        self.free = 40 * GIB
        self.reserved = 3 * GIB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 * GIB))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)


def test_another_engines_allocation_during_the_capture_is_not_counted(monkeypatch):
    fake = FakeDevice()
    fake.install(monkeypatch)

    def capture() -> None:
        fake.reserved += 300 << 20  # this engine's graph pool
        fake.free -= (300 << 20) + (20 << 20)  # ... and the driver's graph objects
        fake.free -= 34 * GIB  # the other engine allocates its KV cache meanwhile

    _, num_bytes = runner.timed_capture(torch.device("cuda"), capture)
    assert num_bytes == (300 << 20) + runner.DRIVER_GRAPH_BYTES  # not 34 GiB more


def test_alone_on_the_gpu_the_driver_memory_counts(monkeypatch):
    fake = FakeDevice()
    fake.install(monkeypatch)

    def capture() -> None:
        fake.reserved += 300 << 20
        fake.free -= (300 << 20) + (20 << 20)

    _, num_bytes = runner.timed_capture(torch.device("cuda"), capture)
    assert num_bytes == (320 << 20)
