"""KV cache manager: each request's block table on top of the block pool.

    request tokens  |t0 .. t15|t16 .. t31|t32 .. t37      |
    block table     [   b4    ,    b9    ,    b2 (partial)]
                      cached     cached    not hashed until full

A request's blocks are hashed (published for prefix hits) once they are full
and their tokens are known, except blocks a remote read is still filling:
those are published by ``cache_blocks`` after the read completes. Each full
block is hashed once per request (``request.block_hashes`` only grows), with
``scheduler.block_hash`` (the request's ``cache_salt`` keys its first block).
"""

from __future__ import annotations

from tandem.scheduler.block_hash import get_block_hasher, hash_request_blocks
from tandem.scheduler.block_pool import BlockPool, KVBlock
from tandem.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        get_block_hasher(hash_algo)  # ValueError naming the field if unknown
        self.hash_algo = hash_algo
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already hashed

    # ---- queries -------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _extend_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            hashes += hash_request_blocks(
                request.all_token_ids,
                self.block_size,
                cache_salt=request.cache_salt,
                algo=self.hash_algo,
                prev_hashes=hashes,
                num_blocks=num_full_blocks,
            )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks. At least one token is always
        left to compute (its logits are needed), so a full hit drops the last
        block. Does not take references; ``allocate_slots`` does. A request
        that wants its prompt's logprobs gets no hit (every prompt token's
        logits are needed)."""
        if not self.enable_prefix_caching:
            return [], 0
        if request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_hit_blocks)
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    # ---- allocation ------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed
        ones (plus the prefix-hit ``new_computed_blocks`` covering
        ``num_new_computed_tokens`` tokens). Returns the ids of the blocks
        added to the request's table, or None (and changes nothing) if the
        pool cannot provide them.

        ``delay_cache_blocks``: do not publish hashes yet (a remote read will
        fill these blocks; ``cache_blocks`` publishes them afterwards).
        """
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:
            # Fast path (every decode step): the request's blocks have room.
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total <= len(blocks) * self.block_size:
                if (
                    not delay_cache_blocks
                    and self.enable_prefix_caching
                    and num_total // self.block_size > self.num_cached_blocks[request.request_id]
                ):
                    self.cache_blocks(request, min(num_total, len(request.all_token_ids)))
                return []
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        computed = new_computed_blocks or ()
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_required = cdiv(num_total, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(computed)
        # Prefix-hit blocks sitting in the free queue are about to be revived,
        # so they cannot also be handed out as new blocks.
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            if not blocks:
                del self.req_blocks[request.request_id]
                del self.num_cached_blocks[request.request_id]
            return None
        if computed:
            self.pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] += len(computed)
        new_blocks = (
            self.pool.get_new_blocks(num_new_blocks, blocks[-1] if blocks else None)
            if num_new_blocks > 0
            else []
        )
        blocks.extend(new_blocks)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(num_total, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks covering its first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            return
        num_full = min(num_tokens // self.block_size, len(blocks))
        start = self.num_cached_blocks[rid]
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        hashes = request.block_hashes
        events = self.pool.events
        run_start, run = start, []  # contiguous newly stored hashes, for events
        for i in range(start, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]):
                run.append(hashes[i])
            elif events is not None:
                events.stored(run, hashes[run_start - 1] if run_start else None)
                run_start, run = i + 1, []
        if events is not None:
            events.stored(run, hashes[run_start - 1] if run_start else None)
        self.num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so its least shared blocks
        are evicted first). Idempotent."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` tokens (the KV slots of
        rejected drafts, ``scheduler/spec/lookahead.py``). None of them is hashed: only
        known tokens are, and drafts are not known tokens."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) <= keep:
            return
        assert self.num_cached_blocks[request.request_id] <= keep, request
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))

    def truncate_computed(self, request: Request, num_tokens: int) -> None:
        """Forget hashes beyond ``num_tokens`` (after a failed remote load the
        blocks will be recomputed; none of them were published)."""
        rid = request.request_id
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(
                self.num_cached_blocks[rid], num_tokens // self.block_size
            )

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for rid, blocks in self.req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{rid} holds a block twice: {ids}"
            for i in ids:
                refs[i] = refs.get(i, 0) + 1
        self.pool.check_integrity(refs)
