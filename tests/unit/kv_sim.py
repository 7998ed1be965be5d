"""An engine for routing tests without torch: a real ``Scheduler`` (block
pool, prefix cache, KV events) driven by ``FakeRunner``."""

from __future__ import annotations

from tandem.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tandem.scheduler.kv_events import KVEventBatch, KVEventRecorder, KVSnapshot
from tandem.wire.engine_protocol import EngineOutput, SamplingParams
from tests.unit.fakes import FakeRunner


class SimEngine:
    def __init__(
        self,
        engine_id: str,
        *,
        epoch: int = 1,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 4,
        max_model_len: int | None = None,
        hash_algo: str = "sha256",
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        cfg = SchedulerConfig(
            num_kv_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=64,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len or min(256, num_blocks * block_size),
            prefix_caching_hash_algo=hash_algo,
        )
        self.sched = Scheduler(cfg, None, engine_id)
        self.events = KVEventRecorder(engine_id, epoch, block_size)
        self.sched.kv.pool.events = self.events
        self.runner = FakeRunner(next_token=lambda rid, pos: 5 + pos % 7)
        self.batches: list[KVEventBatch] = []
        self.first_outputs: dict[str, EngineOutput] = {}
        self.num_steps = 0

    def add(
        self, rid: str, tokens: list[int], max_tokens: int = 2, salt: str | None = None
    ) -> None:
        self.sched.add_request(
            Request(rid, tokens, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        )

    def abort(self, rid: str) -> None:
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        self.num_steps += 1
        so = self.sched.schedule()
        outs = self.sched.update_from_output(so, self.runner.execute(so))
        for o in outs.outputs:
            self.first_outputs.setdefault(o.request_id, o)
        batch = self.events.drain(float(self.num_steps))
        if batch is not None:
            self.batches.append(batch)

    def run_until_idle(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError(f"{self.engine_id} did not drain in {max_steps} steps")

    def take_batches(self) -> list[KVEventBatch]:
        out, self.batches = self.batches, []
        return out

    def cached(self) -> set[bytes]:
        return set(self.sched.kv.pool.cached)

    def reset_prefix_cache(self) -> bool:
        done = self.sched.reset_prefix_cache()
        batch = self.events.drain(float(self.num_steps))
        if batch is not None:
            self.batches.append(batch)
        return done

    def snapshot(self) -> KVSnapshot:
        return self.events.snapshot(list(self.sched.kv.pool.cached))
