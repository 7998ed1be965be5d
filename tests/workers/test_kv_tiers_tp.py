"""KV tiers under tensor parallelism (kvtransfer/tiers/ranks.py): a TP=2 engine on CPU
(gloo) whose ranks each keep their own KV shard's blocks in host and disk tiers.
Greedy fp32 tokens equal the TP=1 engine's without tiers while prefixes are evicted
to host and disk and loaded back on both ranks; a load failing on rank 1 only is
recomputed on both (a hook corrupting its host tier, or its disk files flipped), the
failed block forgotten and stored again on both; the disk tier of each rank survives a
restart and a TP=1 engine never reads it. Every scenario ends with ``check_integrity()``, which checks every
rank's tiers (nothing pinned, loading or leaked)."""

from __future__ import annotations

import pytest

from tandem.kvtransfer.tiers.disk import header_bytes
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.parallel.messages import CMD_KV_STATS, REPLY_KV_STATS
from tests.workers.hf_checkpoints import make_config
from tests.workers.test_kv_tiers import flip_every_block

pytestmark = pytest.mark.slow

SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
GIB = 1 << 30
FILE_HEADER = header_bytes(1)  # a segment's header page: budget one a block (sha256 keys)
BLOCK = 8


def prompts_with_shared_prefixes(n: int = 4, length: int = 36) -> list[list[int]]:
    out = []
    for i in range(n):
        p = [(i * 7 + j * 3) % 250 + 5 for j in range(length)]
        if i % 2:  # every other prompt continues its predecessor's first 3 blocks
            p[: 3 * BLOCK] = out[-1][: 3 * BLOCK]
        out.append(p)
    return out


def rank_block_bytes() -> int:
    """One KV block of one rank's shard (2 KV heads over 2 ranks: one each), fp32."""
    c = make_config("llama")
    head_dim = c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * BLOCK * (c.num_key_value_heads // 2) * head_dim * 4


def engine(path: str, tp: int, host_blocks: int = 0, disk_blocks: int = 0, disk_dir=None, **kw):
    cfg = dict(
        model=path,
        dtype="float32",
        block_size=BLOCK,
        tensor_parallel_size=tp,
        torch_threads=1,
        max_num_batched_tokens=48,
        **kw,
    )
    bb = rank_block_bytes()
    if host_blocks:
        cfg["kv_offloading_size"] = host_blocks * bb / GIB
    if disk_blocks:
        cfg["kv_offloading_disk_dir"] = str(disk_dir)
        cfg["kv_offloading_disk_size"] = disk_blocks * (bb + FILE_HEADER) / GIB
    return LLM(EngineConfig.from_flat(**cfg))


def settle(llm: LLM) -> None:
    """Rank 0's stores done; the engine check flushes and checks every other rank's."""
    assert llm.engine.connector_worker.store.flush(30), "tier stores did not drain"
    llm.engine.check_integrity()


def rank_stats(llm: LLM) -> list[dict[str, float]]:
    """Every rank's tier counters, rank 0 first."""
    replies = llm.engine.tp.ask_workers(CMD_KV_STATS, REPLY_KV_STATS)
    return [llm.engine.connector_worker.store.stats(), *(r.kv_stats for r in replies)]


def tokens(llm: LLM, prompts) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling_params=SP)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("ckpt-tp-tiers"))


@pytest.fixture(scope="module")
def want(checkpoint) -> list[list[int]]:
    with engine(checkpoint, 1, num_kv_blocks=64) as ref:
        out = tokens(ref, prompts_with_shared_prefixes())
        ref.engine.check_integrity()
    return out


def test_tp2_tiers_evict_to_host_and_disk_and_load_back_on_every_rank(checkpoint, want, tmp_path):
    prompts = prompts_with_shared_prefixes()
    # 12 device blocks, 2 sequences of 6 at once: every round evicts the last one's
    # prefixes; the host tier holds 8 blocks, the rest goes on to disk
    with engine(
        checkpoint,
        2,
        host_blocks=8,
        disk_blocks=64,
        disk_dir=tmp_path / "kv",
        num_kv_blocks=12,
        max_num_seqs=2,
    ) as llm:
        assert llm.engine.kv_cache[0].numel() * 4 == rank_block_bytes()
        assert llm.engine.tp.check_ranks  # check_integrity() asks rank 1 too
        for _ in range(3):
            assert tokens(llm, prompts) == want
            settle(llm)
        # one prompt at a time: its whole prefix comes back from the tiers of both ranks
        # (a second try where rank 1's copy of a block was cancelled as its device block
        # was reused while rank 0's had committed: that block is stored again, ranks.py)
        for p, w in zip(prompts, want, strict=True):
            for _ in range(3):
                (r,) = llm.generate(prompt_token_ids=[p], sampling_params=SP)
                assert r.token_ids == w
                settle(llm)
                if r.num_cached_tokens == 32:
                    break
            assert r.num_cached_tokens == 32
        stats = rank_stats(llm)
        for rank, s in enumerate(stats):
            assert s["host_hits"] > 0 and s["disk_hits"] > 0, (rank, s)
        assert stats[0].get("load_failures", 0) == 0, stats[0]
        # each rank keeps its own directory, fingerprinted with the TP size and rank
        assert sorted(d.name for d in (tmp_path / "kv").iterdir()) == [
            "engine-0.tp2-rank0",
            "engine-0.tp2-rank1",
        ]
    # a restart re-indexes both ranks' disk tiers; TP=1 never reads them (its own dir)
    with engine(
        checkpoint, 2, disk_blocks=64, disk_dir=tmp_path / "kv", num_kv_blocks=12, max_num_seqs=2
    ) as llm:
        assert llm.engine.connector_worker.store.disk.num_reindexed > 0
        got = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
        assert got[0].token_ids == want[0] and got[0].num_cached_tokens == 32
        settle(llm)
        assert [s["disk_hits"] for s in rank_stats(llm)] == [4, 4]
    with engine(checkpoint, 1, disk_blocks=64, disk_dir=tmp_path / "kv", num_kv_blocks=12) as llm:
        assert llm.engine.connector_worker.store.disk.num_reindexed == 0
        assert tokens(llm, prompts[:1]) == want[:1]
        settle(llm)


def test_a_load_failing_on_one_rank_is_recomputed_on_every_rank(checkpoint, want):
    prompts = prompts_with_shared_prefixes()
    with engine(
        checkpoint,
        2,
        host_blocks=64,
        num_kv_blocks=12,
        max_num_seqs=2,
        extra={"kv_tiers": {"corrupt_host_on_rank": 1}},
    ) as llm:
        assert tokens(llm, prompts) == want
        settle(llm)
        # prompt 0's prefix left the device; its load fails its checksum on rank 1 only
        (r,) = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens < 32
        settle(llm)
        rank0, rank1 = rank_stats(llm)
        assert rank1["load_failures"] >= 1 and rank0.get("load_failures", 0) == 0
        # each failed block is forgotten on both ranks and stored again when recomputed:
        # within a few turns the whole prefix loads on both ranks again
        for _ in range(4):
            tokens(llm, prompts[2:])  # pushes prompt 0 off the device
            settle(llm)
            (r,) = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
            assert r.token_ids == want[0]
            settle(llm)
            if r.num_cached_tokens == 32:
                break
        assert r.num_cached_tokens == 32


def test_corrupt_disk_blocks_of_one_rank_are_recomputed_on_both(checkpoint, want, tmp_path):
    prompts = prompts_with_shared_prefixes()
    kw = dict(disk_blocks=64, disk_dir=tmp_path / "kv", num_kv_blocks=12, max_num_seqs=2)
    with engine(checkpoint, 2, **kw) as llm:
        assert tokens(llm, prompts[:1]) == want[:1]
        settle(llm)
    # a flipped byte in each of rank 1's blocks; rank 0's are intact. Prompt 0 and its
    # output: 42 tokens, 5 full blocks
    assert flip_every_block(tmp_path / "kv" / "engine-0.tp2-rank1") == 5
    with engine(checkpoint, 2, **kw) as llm:  # an empty device cache: the disk is all
        (r,) = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens == 0
        settle(llm)
        rank0, rank1 = rank_stats(llm)
        assert rank0.get("load_failures", 0) == 0 and rank0["disk_hits"] > 0
        assert rank1["load_failures"] == 1 and rank1.get("disk_hits", 0) == 0
        # the bad block was forgotten on both ranks, so its recomputation stored it on both
        assert rank0["disk_stored_blocks"] == rank1["disk_stored_blocks"] == 1


def test_late_and_aborted_loads_and_a_reset_reach_every_rank(checkpoint, want):
    prompts = prompts_with_shared_prefixes()
    with engine(
        checkpoint,
        2,
        host_blocks=64,
        num_kv_blocks=12,
        max_num_seqs=2,
        extra={"kv_tiers": {"load_timeout_s": 0.0}},
    ) as llm:
        assert tokens(llm, prompts) == want
        settle(llm)
        (r,) = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens <= 24  # late on every rank
        settle(llm)
        assert all(s["load_timeouts"] > 0 for s in rank_stats(llm))
        # abort a request while its load is queued: rank 1 hears of it with the next step
        tokens(llm, prompts[2:])
        settle(llm)
        core = llm.engine
        assert core.add_request(EngineRequest("abort-me", prompts[0], SP)) is None
        core.step()
        assert "abort-me" in core.scheduler.waiting_for_remote
        core.abort(["abort-me"])
        for _ in range(1000):
            if not core.has_work():
                break
            core.step()
        settle(llm)
        # reset_prefix_cache empties every rank's tiers (told with the next step)
        assert core.reset_prefix_cache()
        (r,) = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens == 0
        settle(llm)
        rank0, rank1 = rank_stats(llm)
        assert rank0["resets"] == rank1["resets"] == 1
        # prompt 0 and its output only (42 tokens: 5 full blocks), stored again on both
        assert rank0["host_blocks"] == rank1["host_blocks"] == 5


def test_tiers_with_tp_refuse_a_kv_connector():
    with pytest.raises(ValueError, match="need kv_connector unset"):
        EngineConfig.from_flat(kv_offloading_size=1, tensor_parallel_size=2, kv_connector="nixl")
