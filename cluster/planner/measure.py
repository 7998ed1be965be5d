"""``tandem profile``: time one in-process engine (``EngineCore``) and write
its performance profile (profile.py).

Prefill: one request of ``n`` prompt tokens (``max_tokens=1``, prefix caching
off) for each ``n`` in the prefill grid; the time of the steps from its arrival
until it is done (timing one step would time a launch under CUDA's overlapped
loop, or one chunk of a split prompt), the fastest of ``repeats`` runs (other load on a shared machine only
adds time). Decode: ``b`` requests whose prompts add up
to ``C`` context tokens for each (``b``, ``C``) of the grid, prefilled first,
then the fastest of ``repeats`` decode steps of the whole batch. A
warm-up request runs first (its steps carry one-time costs: an engine's
cold-start steps do not count as its speed). The handoff figures are not
measured here (that needs two engines and a transport): they are given
(``--transfer-bytes-per-s``, ``--transfer-latency-ms``), and the KV bytes
per token come from the model's shape and dtype. With ``shared_cores``
(``--shared-cores``: the engines of the deployment share that many cores, a
CPU box) the profile gets a ``host`` section (contention.py) whose
``engine_threads`` is what the profiled engine computes with: torch's
threads in this process times the tensor-parallel workers.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from tandem.cluster.planner.contention import HostShare
from tandem.cluster.planner.profile import Profile, TransferCost
from tandem.wire.engine_protocol import EngineRequest, SamplingParams

PREFILL_TOKENS = [16, 64, 128, 256, 512]
DECODE_BATCH_SIZES = [1, 4, 16]
DECODE_CONTEXT_TOKENS = [64, 512, 2048]


def kv_bytes_per_token(hf_config: Any, dtype: Any) -> int:
    layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    itemsize = getattr(dtype, "itemsize", 4)
    return int(2 * layers * heads * head_dim * itemsize)


class _Timer:
    def __init__(self, engine: Any) -> None:
        self.engine, self.next_id = engine, 0

    def add(self, num_tokens: int, max_tokens: int) -> str:
        self.next_id += 1
        rid = f"prof-{self.next_id}"
        # distinct prompts: no request hits another's blocks
        prompt = [(self.next_id * 7919 + i) % 50 + 3 for i in range(num_tokens)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        err = self.engine.add_request(EngineRequest(rid, prompt, sp))
        if err is not None:
            raise ValueError(f"profile request of {num_tokens} tokens: {err.error}")
        return rid

    def step_s(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def drain_s(self) -> float:
        """Every step until the engine is idle: a prompt's whole prefill, also when the
        engine splits it over steps or overlaps steps (CUDA's default async scheduling
        returns a step's tokens from the next step)."""
        t0 = time.perf_counter()
        self.drain()
        return time.perf_counter() - t0

    def drain(self) -> None:
        while self.engine.has_work():
            self.engine.step()


def measure(
    model: str = "tiny",
    repeats: int = 3,
    prefill_tokens: list[int] | None = None,
    batch_sizes: list[int] | None = None,
    context_tokens: list[int] | None = None,
    transfer_bytes_per_s: float = 1.0e9,
    transfer_latency_s: float = 0.002,
    engine_overrides: dict[str, Any] | None = None,
    shared_cores: float | None = None,
) -> Profile:
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    prefill_tokens = prefill_tokens or PREFILL_TOKENS
    batch_sizes = batch_sizes or DECODE_BATCH_SIZES
    context_tokens = context_tokens or DECODE_CONTEXT_TOKENS
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    need = max(max(prefill_tokens), max(context_tokens)) + repeats + 8
    fields = {"enable_prefix_caching": False, "max_num_batched_tokens": max(2048, need)}
    fields.setdefault("max_model_len", need)
    fields.update(engine_overrides or {})
    engine = EngineCore(EngineConfig.from_flat(model=model, **fields))
    try:
        t = _Timer(engine)
        t.add(32, 4)  # warm-up
        t.drain()
        prefill = []
        for n in prefill_tokens:
            samples = []
            for _ in range(repeats):
                t.add(n, 1)
                samples.append(t.drain_s())
            prefill.append(min(samples))
        decode = []
        for b in batch_sizes:
            row = []
            for c in context_tokens:
                per = max(1, c // b)
                for _ in range(b):
                    t.add(per, repeats + 2)
                t.step_s()  # the prefill step(s), then the first decode step
                while any(
                    r.num_computed_tokens < r.num_prompt_tokens
                    for r in engine.scheduler.running + list(engine.scheduler.waiting)
                ):
                    t.step_s()
                row.append(min(t.step_s() for _ in range(repeats)))
                t.drain()
            decode.append(row)
        sched = engine.sched_config
        host = None
        if shared_cores is not None:
            import torch

            threads = torch.get_num_threads() * engine.config.parallel.tensor_parallel_size
            host = HostShare(cores=shared_cores, engine_threads=threads)
        return Profile(
            host=host,
            prefill_tokens=list(prefill_tokens),
            prefill_time_s=prefill,
            decode_batch_sizes=list(batch_sizes),
            decode_context_tokens=list(context_tokens),
            decode_time_s=decode,
            transfer=TransferCost(
                transfer_bytes_per_s,
                transfer_latency_s,
                kv_bytes_per_token(engine.hf_config, engine.dtype),
            ),
            scheduler={
                "block_size": sched.block_size,
                "num_kv_blocks": sched.num_kv_blocks,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_num_seqs": sched.max_num_seqs,
                "max_model_len": sched.max_model_len,
            },
            meta={
                "model": model,
                "device": engine.config.model.device,
                "tensor_parallel_size": engine.config.parallel.tensor_parallel_size,
                "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%dT%H:%M:%SZ"
                ),
            },
        )
    finally:
        engine.check_integrity()
        engine.shutdown()
