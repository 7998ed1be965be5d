"""The host-memory tier: a fixed array of block slots with its own LRU.

    data   [num_slots, block_bytes] uint8   (pinned on CUDA: async copies both ways)
    index  key -> HostEntry(slot, checksum)  OrderedDict, least recently used first
    free   slots holding nothing; reserved slots are being filled (not in the index)

Not thread-safe by itself: ``TierStore`` calls every method under its lock and
copies the bytes of a reserved or pinned slot outside it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class HostEntry:
    __slots__ = ("slot", "checksum")

    def __init__(self, slot: int, checksum: int) -> None:
        self.slot = slot
        self.checksum = checksum


class HostTier:
    medium = "host"

    def __init__(
        self, num_slots: int, block_bytes: int, pin: bool, is_pinned: Callable[[bytes], bool]
    ) -> None:
        if num_slots < 1:
            raise ValueError(
                f"--kv-offloading-size holds no KV block of {block_bytes} bytes; raise it"
            )
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.data = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.index: OrderedDict[bytes, HostEntry] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.reserved: set[int] = set()
        self._is_pinned = is_pinned  # TierStore: a load is reading this key
        self.num_evictions = 0
        # TierStore: (medium, key, stored) on every index change (KV events)
        self.on_change: Callable[[str, bytes, bool], None] | None = None

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    @property
    def used_bytes(self) -> int:
        return len(self.index) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def touch(self, key: bytes) -> None:
        self.index.move_to_end(key)

    def reserve(self) -> int | None:
        """A slot to fill: a free one, else the least recently used unpinned
        entry's (evicted). None when every slot is pinned or being filled."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k in self.index if not self._is_pinned(k)), None)
            if victim is None:
                return None
            slot = self.index.pop(victim).slot
            self.num_evictions += 1
            self._changed(victim, False)
        self.reserved.add(slot)
        return slot

    def commit(self, key: bytes, slot: int, checksum: int) -> None:
        self.reserved.remove(slot)
        if key in self.index:  # stored meanwhile by another job: keep that copy
            self.free.append(slot)
            return
        self.index[key] = HostEntry(slot, checksum)
        self._changed(key, True)

    def release(self, slot: int) -> None:
        """Give back a reserved slot whose copy was cancelled."""
        self.reserved.remove(slot)
        self.free.append(slot)

    def drop(self, key: bytes) -> None:
        """Forget a corrupted entry."""
        entry = self.index.pop(key, None)
        if entry is not None:
            self.free.append(entry.slot)
            self._changed(key, False)

    def _changed(self, key: bytes, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(self.medium, key, stored)

    def check_integrity(self) -> None:
        slots = [e.slot for e in self.index.values()]
        everything = slots + self.free + sorted(self.reserved)
        assert len(everything) == len(set(everything)), "host tier slot owned twice"
        assert sorted(everything) == list(range(self.num_slots)), (
            f"host tier slots leaked: {self.num_slots - len(set(everything))}"
        )
