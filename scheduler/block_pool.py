"""Block pool: ref-counted KV blocks, prefix-cache hash map, LRU free queue.

    free queue (LRU first)        hash map
    head <-> b7 <-> b2 <-> tail    hash(parent, tokens, extra keys) -> block
             ^ cached, ref 0        (full blocks only; scheduler/block_hash.py)

A block with ``ref_cnt == 0`` sits in the free queue; if it still has a
hash it is an evictable cached block that a prefix hit can revive. New
blocks come from the head (least recently freed), evicting its hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.block_hash import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list with O(1) append, popleft and remove-from-middle."""

    def __init__(self, blocks: Sequence[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        last.next = block  # type: ignore[union-attr]
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free_blocks += 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # scheduler.kv_events.KVEventRecorder when KV events are on (routing)
        self.events = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            b = self.free_queue.popleft()
            if b.block_hash is not None:  # evict from the prefix cache
                del self.cached[b.block_hash]
                if self.events is not None:
                    self.events.removed(b.block_hash)
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks (revive them from the free queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Publish a full, computed block under ``block_hash``; True if the
        hash is new in the cache. If another block already holds that hash
        (two requests computed the same prefix), the first one stays the
        canonical copy."""
        if block.block_hash is not None or not self.enable_caching:
            return False
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each. Pass blocks in eviction order (the tail of a
        request first) so the least useful cached blocks are evicted first."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)
            elif b.ref_cnt < 0:
                raise AssertionError(f"double free of {b}")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use,
        since running requests may still count on their hashes."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """``expected_refs``: block id -> number of owners, from every block table."""
        free_ids = set()
        for b in self.free_queue:
            assert b.ref_cnt == 0, f"{b} in free queue with refs"
            assert b.block_id not in free_ids, f"{b} twice in free queue"
            free_ids.add(b.block_id)
        assert len(free_ids) == self.free_queue.num_free_blocks, "free count drift"
        for b in self.blocks:
            want = expected_refs.get(b.block_id, 0)
            assert b.ref_cnt == want, f"{b}: ref_cnt {b.ref_cnt} != owners {want}"
            assert (b.ref_cnt == 0) == (b.block_id in free_ids), f"{b} free-queue mismatch"
            if b.block_hash is not None:
                assert self.cached.get(b.block_hash) is b, f"{b} hash not mapped"
        for h, b in self.cached.items():
            assert b.block_hash == h, f"stale hash map entry for {b}"
