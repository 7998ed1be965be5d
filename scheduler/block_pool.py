"""Block pool: ref-counted KV blocks, prefix-cache hash map, LRU free queue.

    free queue (LRU first)        hash map
    head <-> b7 <-> b2 <-> tail    hash(parent, tokens, extra keys) -> block
             ^ cached, ref 0        (full blocks only; scheduler/block_hash.py)

A block with ``ref_cnt == 0`` sits in the free queue; if it still has a
hash it is an evictable cached block that a prefix hit can revive.

Allocation hands out runs of consecutive ids where it can (a KV READ posts
one NIXL descriptor per run consecutive on both engines), in this order:

1. growth: the ids right after the request's last block, while they are
   free and hold no hash;
2. uncached free blocks, lowest id first, each taken with the free uncached
   ids after it (address-ordered first fit; a min-heap of free uncached ids);
3. only then cached free blocks: the queue head (least recently freed) is
   always the next victim, together with its free neighbours by id that were
   freed in the older half of the queue's history (``free_tick`` between the
   head's and the midpoint to the newest) and were never prefix-hit since
   they were handed out (``was_hit``), up to the blocks still needed; the
   victims are handed out sorted by id.

An uncached free block has nothing to lose, so taking it before evicting any
cached block never costs a prefix hit. Step 3 is the one departure from strict
LRU: a victim's run-neighbour may go before blocks freed earlier than it, but
never a block from the recently freed half nor one a hit has shared (where
hot prefixes sit). On Zipf shared-prefix traffic with a cache 1.3-10x
smaller than the prefixes (benchmarks/prefix_eviction.py) this costs 0.3-0.6
points of hit rate against strict LRU (0.7-2.5 without the ``was_hit`` rule)
and cuts runs of ids per block from 0.5-0.75 to 0.08-0.33. ``BlockPool(evict_runs=False)``
evicts strictly in LRU order.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from tandem.scheduler.block_hash import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "free_tick", "was_hit")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None
        self.free_tick = 0  # BlockPool's free-call counter when last freed
        self.was_hit = False  # a prefix hit (or a fork) shared it since it was handed out

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

    def first(self) -> KVBlock:
        """The least recently freed block (not removed)."""
        block = self._head.next
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        return block

    def last(self) -> KVBlock:
        """The most recently freed block (not removed)."""
        block = self._tail.prev
        if block is self._head or block is None:
            raise ValueError("no free blocks")
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
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, evict_runs: bool = True
    ) -> None:
        """``evict_runs``: when a cached block is evicted, also take its free
        neighbours by id freed in the older half of the queue's history and
        never prefix-hit (see the module docstring); False evicts strictly in
        LRU order."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.evict_runs = evict_runs
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # ids of free blocks without a hash; stale entries (taken or since
        # hashed) are skipped when popped and dropped on compaction
        self._uncached_ids: list[int] = list(range(num_blocks))
        self._free_clock = 0
        # scheduler.kv_events.KVEventRecorder when KV events are on (routing)
        self.events = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def _is_free_uncached(self, block_id: int) -> bool:
        if block_id >= self.num_blocks:
            return False
        b = self.blocks[block_id]
        return b.ref_cnt == 0 and b.block_hash is None and b.prev is not None

    def _take(self, block: KVBlock, out: list[KVBlock]) -> None:
        self.free_queue.remove(block)
        if block.block_hash is not None:  # evict from the prefix cache
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        block.was_hit = False
        out.append(block)

    def _take_run(self, start_id: int, num_blocks: int, out: list[KVBlock]) -> int:
        """Take up to ``num_blocks`` free uncached blocks ``start_id, start_id+1, ...``;
        returns how many were taken."""
        taken, i = 0, start_id
        while taken < num_blocks and self._is_free_uncached(i):
            self._take(self.blocks[i], out)
            taken += 1
            i += 1
        return taken

    def get_new_blocks(self, num_blocks: int, after: KVBlock | None = None) -> list[KVBlock]:
        """``num_blocks`` blocks with one reference each, as runs of consecutive
        ids where possible (module docstring). ``after``: the request's last
        block, whose successors continue its run. The first blocks returned
        continue ``after``; the rest are in ascending id order within each
        step. O(blocks taken + log(free blocks)) amortised."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, {self.num_free_blocks} free")
        out: list[KVBlock] = []
        need = num_blocks
        if after is not None:
            need -= self._take_run(after.block_id + 1, need, out)
        heap = self._uncached_ids
        while need and heap:
            i = heapq.heappop(heap)
            need -= self._take_run(i, need, out)
        if need:
            evicted: list[KVBlock] = []
            while len(evicted) < need:
                self._evict_run(need - len(evicted), evicted)
            evicted.sort(key=lambda b: b.block_id)
            out += evicted
        return out

    def _evict_run(self, num_blocks: int, out: list[KVBlock]) -> None:
        """Evict the least recently freed block and up to ``num_blocks - 1`` free
        neighbours of it by id that were freed in the older half of the queue's
        history (ticks) and were never prefix-hit, so a run comes out without
        touching recently freed or shared (likely hot) blocks."""
        queue = self.free_queue
        head = queue.first()
        newest = queue.last()
        if not self.evict_runs:
            self._take(head, out)
            return
        limit = head.free_tick + (newest.free_tick - head.free_tick) // 2
        blocks = self.blocks
        lo = hi = head.block_id
        budget = num_blocks - 1
        while budget and lo > 0:
            b = blocks[lo - 1]
            if b.ref_cnt or b.prev is None or b.free_tick > limit or b.was_hit:
                break
            lo -= 1
            budget -= 1
        while budget and hi + 1 < self.num_blocks:
            b = blocks[hi + 1]
            if b.ref_cnt or b.prev is None or b.free_tick > limit or b.was_hit:
                break
            hi += 1
            budget -= 1
        for i in range(lo, hi + 1):
            self._take(blocks[i], out)

    def _push_uncached(self, block: KVBlock) -> None:
        heap = self._uncached_ids
        heapq.heappush(heap, block.block_id)
        if len(heap) > 2 * self.num_blocks + 64:  # compact stale entries
            live = {i for i in heap if self._is_free_uncached(i)}
            heap[:] = sorted(live)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks (revive them from the free
        queue); marks them ``was_hit`` so run eviction spares them."""
        for b in blocks:
            b.was_hit = True
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
        self._free_clock += 1
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                b.free_tick = self._free_clock
                self.free_queue.append(b)
                if b.block_hash is None:
                    self._push_uncached(b)
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
        self._uncached_ids = list(range(self.num_blocks))
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
        heap_ids = set(self._uncached_ids)
        for i in free_ids:
            if self.blocks[i].block_hash is None:
                assert i in heap_ids, f"free uncached block {i} missing from the id heap"
