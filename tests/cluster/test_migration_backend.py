"""Migration in the gateway's backend (RayBackend.generate + StreamLedger),
without Ray: the test plays two colocated engines over the real ZMQ data
plane (fake actors answer the control calls). A stream whose engine dies
goes on on the other engine with prompt + sent tokens, none repeated or
missing, late outputs of the dead engine ignored; once ``max_migrations``
is spent the stream ends with an explicit error event; with migration off
it ends with the error at once. With 1 prefill + 3 decode engines and the
kv-aware router, a migrated stream goes to the survivor whose prefix cache
holds its context and recomputes there, without the prefill engine."""

from __future__ import annotations

import asyncio

import msgspec
import zmq
import zmq.asyncio

from benchmarks._synthetic_engine import LocalMethod
from tandem.cluster.disagg.migration import MigrationPolicy
from tandem.cluster.disagg.ray_backend import RayBackend
from tandem.cluster.engines.actor import free_port
from tandem.cluster.engines.pools import EngineHandle
from tandem.cluster.routing.policy import RoutingConfig
from tandem.scheduler.block_hash import hash_request_blocks
from tandem.scheduler.engine_stats import EngineStats
from tandem.scheduler.kv_events import KVSnapshot
from tandem.wire.engine_protocol import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    SamplingParams,
)
from tandem.wire.frames import decode

PROMPT = [1, 5, 9, 14]
ENGINE_IDS = ("colocated-0", "colocated-1")
BLOCK_SIZE = 16


class FakeEngine:
    """One engine: a bound input PULL (what the gateway sends), an output
    PUSH to the gateway, and the actor's control calls. ``die()``: Ray now
    says the actor died and its input socket closes (a dropped connection)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, engine_id: str, output_addr: str, role: str = "colocated"
    ) -> None:
        self.engine_id = engine_id
        self.dead = False
        self.input_addr = f"tcp://127.0.0.1:{free_port()}"
        self.inp = ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.LINGER, 0)
        self.inp.bind(self.input_addr)
        self.out = ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(output_addr)
        info = {
            "engine_id": engine_id,
            "role": role,
            "epoch": 1,
            "input_addr": self.input_addr,
            "max_model_len": 4096,
            "max_num_seqs": 8,
            # what the kv-aware router reads (no kv_events_addr: the test
            # feeds the prefix index itself)
            "block_size": BLOCK_SIZE,
            "prefix_caching_hash_algo": "sha256",
            "num_kv_blocks": 1024,
        }
        if role == "prefill":
            info["kv_address"] = ["127.0.0.1", 1]
        self.ready = LocalMethod(self._answer(lambda: info))
        self.stats = LocalMethod(
            self._answer(lambda: msgspec.msgpack.encode(EngineStats(engine_id, role, 1)))
        )
        self.set_prefill_endpoints = LocalMethod(self._answer(lambda endpoints: True))

    def _answer(self, fn):
        def call(*args):
            if self.dead:
                raise RuntimeError(f"the actor {self.engine_id} died")  # as Ray's ActorDiedError
            return fn(*args)

        return call

    async def recv_request(self) -> EngineRequest:
        while True:
            kind, payload = await asyncio.wait_for(self.inp.recv_multipart(), 30)
            if kind == b"R":
                return decode(msgspec.msgpack.Decoder(EngineRequest), payload)

    async def send(self, rid: str, tokens: list[int], finish: FinishReason | None = None) -> None:
        out = EngineOutput(rid, new_token_ids=tokens, finish_reason=finish)
        batch = EngineOutputs(self.engine_id, [out], 0.0)
        await self.out.send_multipart([b"O", msgspec.msgpack.encode(batch)])

    def die(self) -> None:
        self.dead = True
        self.inp.close(linger=0)

    def close(self) -> None:
        self.inp.close(linger=0)
        self.out.close(linger=0)


async def with_backend(
    policy: MigrationPolicy,
    scenario,
    roles: dict[str, str] | None = None,
    routing: RoutingConfig | None = None,
    disagg_min_tokens: int = 0,
) -> None:
    """``roles``: engine id -> role (default: ``ENGINE_IDS``, colocated)."""
    roles = roles or dict.fromkeys(ENGINE_IDS, "colocated")
    output_addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.asyncio.Context()
    engines = {eid: FakeEngine(ctx, eid, output_addr, role) for eid, role in roles.items()}
    backend = RayBackend(
        [EngineHandle(eid, roles[eid], e) for eid, e in engines.items()],
        tokenizer=None,
        model_name="m",
        output_addr=output_addr,
        disagg_min_tokens=disagg_min_tokens,
        engine_dead_after_s=120.0,
        routing=routing or RoutingConfig(router="least-load"),
        migration=policy,
    )
    try:
        await backend.start(ready_timeout_s=30)
        await scenario(backend, engines)
    finally:
        await backend.close()
        for e in engines.values():
            e.close()
        ctx.term()


class Client:
    """Consumes ``backend.generate(request)`` like the gateway does."""

    def __init__(self, backend: RayBackend, request: EngineRequest) -> None:
        self.outputs: list[EngineOutput] = []
        self.task = asyncio.create_task(self._run(backend, request))

    async def _run(self, backend, request) -> None:
        async for out in backend.generate(request):
            self.outputs.append(out)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    async def wait_tokens(self, n: int) -> None:
        async def poll():
            while len(self.tokens) < n:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), 30)


def request(max_tokens: int = 8) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=3, temperature=0.8, seed=7)
    return EngineRequest("r-1", list(PROMPT), params)


async def first_engine(engines: dict[str, FakeEngine]) -> tuple[FakeEngine, EngineRequest]:
    tasks = {asyncio.create_task(e.recv_request()): e for e in engines.values()}
    done, pending = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    assert done, "no engine got the request"
    task = done.pop()
    return tasks[task], task.result()


def test_migrates_without_repeat_or_gap_then_errors_past_max_migrations():
    async def scenario(backend: RayBackend, engines: dict[str, FakeEngine]) -> None:
        client = Client(backend, request())
        first, req = await first_engine(engines)
        assert req.prompt_token_ids == PROMPT
        await first.send("r-1", [11])
        await first.send("r-1", [12])
        await client.wait_tokens(2)
        first.die()  # its streams migrate to the other engine
        other = next(e for e in engines.values() if e is not first)
        again = await other.recv_request()
        assert again.request_id == "r-1"
        assert again.prompt_token_ids == PROMPT + [11, 12]
        sp = again.sampling_params
        assert (sp.max_tokens, sp.min_tokens, sp.seed) == (6, 1, 7)
        assert sp.num_penalty_prompt_tokens == len(PROMPT)
        await first.send("r-1", [99])  # a late output of the lost engine
        await other.send("r-1", [13])
        await client.wait_tokens(3)
        assert backend.migrator.num_migrations == {"engine_dead": 1}
        other.die()  # max_migrations=1 is spent: an explicit error, no third engine
        await asyncio.wait_for(client.task, 30)
        assert client.tokens == [11, 12, 13]
        last = client.outputs[-1]
        assert last.finish_reason == FinishReason.ERROR
        assert "migrated 1 times already" in last.error
        assert backend.migrator.num_migrations == {"engine_dead": 1}
        assert all(not e.requests for e in backend.engines.values())

    asyncio.run(asyncio.wait_for(with_backend(MigrationPolicy(max_migrations=1), scenario), 90))


def test_no_migration_ends_the_stream_with_the_error():
    async def scenario(backend: RayBackend, engines: dict[str, FakeEngine]) -> None:
        client = Client(backend, request())
        first, _ = await first_engine(engines)
        await first.send("r-1", [11])
        await client.wait_tokens(1)
        first.die()
        await asyncio.wait_for(client.task, 30)
        assert client.tokens == [11]
        assert client.outputs[-1].finish_reason == FinishReason.ERROR
        assert first.engine_id in client.outputs[-1].error
        assert backend.migrator.num_migrations == {}

    asyncio.run(asyncio.wait_for(with_backend(MigrationPolicy(enabled=False), scenario), 90))


def test_migration_prefers_the_survivor_holding_the_prefix_and_skips_prefill():
    """1 prefill + 3 decode engines, kv-aware. The stream's decode engine dies
    after 2 tokens; of the two survivors, one holds the first 40 blocks of the
    context. The context (643 tokens) is past ``handoff_min_tokens`` (256),
    which used to send every such migration through the prefill engine; the
    holder lacks only 3 tokens, so it recomputes them itself."""
    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    roles["decode-2"] = "decode"
    prompt = [3 + i % 250 for i in range(641)]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def scenario(backend: RayBackend, engines: dict[str, FakeEngine]) -> None:
        decoders = {eid: e for eid, e in engines.items() if eid.startswith("decode")}
        client = Client(backend, EngineRequest("r-1", list(prompt), params))
        first, req = await first_engine(decoders)  # a short first attempt: local on D
        assert req.prompt_token_ids == prompt
        await first.send("r-1", [11])
        await first.send("r-1", [12])
        await client.wait_tokens(2)
        holder, other = sorted(eid for eid in decoders if eid != first.engine_id)
        # the holder's cache has the context's first 40 full blocks (e.g. an
        # earlier request with the same system prompt)
        context = prompt + [11, 12]
        hashes = hash_request_blocks(context, BLOCK_SIZE, algo="sha256")[:40]
        backend.routing.index.load_snapshot(KVSnapshot(holder, 1, 1, hashes))
        assert len(hashes) == 40
        first.die()
        survivors = {eid: e for eid, e in engines.items() if e is not first}
        target, again = await first_engine(survivors)
        assert target.engine_id == holder, f"the migrated stream went to {target.engine_id}"
        assert again.prompt_token_ids == context and again.kv_transfer_params is None
        await engines[holder].send("r-1", [13, 14, 15, 16], FinishReason.LENGTH)
        await asyncio.wait_for(client.task, 30)
        assert client.tokens == [11, 12, 13, 14, 15, 16]  # none repeated, none missing
        assert backend.migrator.num_migrations == {"engine_dead": 1}
        fields = backend.route_log_fields("r-1")
        assert fields["decode_engine"] == holder and fields["decode_reason"] == "prefix_hit"
        assert fields["route_reason"] == "migration_recompute"
        assert "prefill_engine" not in fields
        assert fields["predicted_hit_tokens"] == 40 * BLOCK_SIZE
        assert backend.routing.decisions()["route/migration_recompute"] == 1
        # neither the prefill engine nor the other survivor saw anything
        for eid in ("prefill-0", other):
            try:
                kind, _ = await asyncio.wait_for(engines[eid].inp.recv_multipart(), 0.3)
            except asyncio.TimeoutError:
                continue
            assert kind != b"R", f"{eid} got the migrated request"
        assert all(not e.requests for e in backend.engines.values())

    asyncio.run(
        asyncio.wait_for(
            with_backend(
                MigrationPolicy(handoff_min_tokens=256),
                scenario,
                roles=roles,
                routing=RoutingConfig(router="kv-aware"),
                disagg_min_tokens=100_000,  # the first attempt prefills on D
            ),
            90,
        )
    )
