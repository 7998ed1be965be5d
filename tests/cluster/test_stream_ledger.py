"""StreamLedger (cluster/disagg/migration.py): what a migrated stream resubmits, and
that a real engine continuing the resubmission produces exactly the tokens of
the undisturbed run after those already sent (none repeated, none missing),
with seeded sampling and output-token penalties."""

from __future__ import annotations

import msgspec
import pytest

from tandem.cluster.disagg.migration import MigrationPolicy, StreamLedger
from tandem.wire.engine_protocol import EngineOutput, EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore

PROMPT = [5, 17, 99, 3, 42, 42, 8, 61, 7, 120, 33]
PARAMS = SamplingParams(
    max_tokens=24,
    min_tokens=20,
    temperature=0.9,
    top_p=0.95,
    seed=1234,
    ignore_eos=True,
    frequency_penalty=1.5,
    presence_penalty=1.0,
    repetition_penalty=1.3,
)


def request(**kw) -> EngineRequest:
    return EngineRequest("req-1", list(PROMPT), msgspec.structs.replace(PARAMS, **kw))


def test_resubmission_continues_after_the_sent_tokens():
    req = msgspec.structs.replace(
        request(prompt_logprobs=2), kv_transfer_params={"do_remote_prefill": True}
    )
    ledger = StreamLedger(req)
    ledger.record(EngineOutput("req-1", new_token_ids=[11]))  # P's first token
    ledger.record(EngineOutput("req-1", new_token_ids=[12, 13]))
    ledger.record(EngineOutput("req-1"))  # an output without tokens
    again = ledger.resubmission()
    assert again.request_id == "req-1"
    assert again.prompt_token_ids == PROMPT + [11, 12, 13]
    sp = again.sampling_params
    assert (sp.max_tokens, sp.min_tokens) == (21, 17)
    assert sp.num_penalty_prompt_tokens == len(PROMPT)  # sent tokens stay output tokens
    assert sp.prompt_logprobs is None  # delivered with the first tokens
    assert (sp.seed, sp.temperature, sp.frequency_penalty) == (1234, 0.9, 1.5)
    assert again.kv_transfer_params is None
    assert req.prompt_token_ids == PROMPT  # the original is untouched
    # a second migration counts from the client's prompt, not the first resubmission
    ledger.record(EngineOutput("req-1", new_token_ids=[14]))
    again = ledger.resubmission()
    assert again.prompt_token_ids == PROMPT + [11, 12, 13, 14]
    assert again.sampling_params.num_penalty_prompt_tokens == len(PROMPT)
    assert again.sampling_params.max_tokens == 20


def test_resubmission_before_any_token_keeps_prompt_logprobs():
    again = StreamLedger(request(prompt_logprobs=2)).resubmission()
    assert again.prompt_token_ids == PROMPT
    assert again.sampling_params.prompt_logprobs == 2


def test_nothing_left_to_generate_is_a_value_error():
    ledger = StreamLedger(request(max_tokens=2, min_tokens=0))
    ledger.record(EngineOutput("req-1", new_token_ids=[1, 2]))
    with pytest.raises(ValueError, match="nothing left"):
        ledger.resubmission()


def test_can_migrate_until_max_migrations():
    ledger = StreamLedger(request())
    policy = MigrationPolicy(max_migrations=2)
    assert ledger.can_migrate(policy)
    ledger.num_migrations = 2
    assert not ledger.can_migrate(policy)
    assert not StreamLedger(request()).can_migrate(MigrationPolicy(enabled=False))
    assert not StreamLedger(request()).can_migrate(MigrationPolicy(max_migrations=0))


def run(core: EngineCore, req: EngineRequest, max_steps: int | None = None) -> list[EngineOutput]:
    """``req`` on ``core`` until it finished (or ``max_steps`` steps with tokens)."""
    assert core.add_request(req) is None
    outs: list[EngineOutput] = []
    while core.has_work() and (max_steps is None or len(outs) < max_steps):
        outs += [o for o in core.step().outputs if o.request_id == req.request_id]
    return outs


def test_migrated_stream_is_token_identical_with_seed_and_penalties():
    """One engine plays both: the lost run is aborted after 7 outputs, then
    the resubmission runs (the next token depends only on the sequence, the
    seed and the position, not on which engine samples it)."""
    core = EngineCore(EngineConfig.from_flat(model="tiny", num_kv_blocks=64, block_size=16))
    try:
        undisturbed = [t for o in run(core, request()) for t in o.new_token_ids]
        assert len(undisturbed) == PARAMS.max_tokens
        ledger = StreamLedger(request())
        for out in run(core, request(), 7):
            ledger.record(out)  # 7 outputs reach the client, then the engine is lost
        core.abort(["req-1"])
        sent = list(ledger.sent_token_ids)
        assert 0 < len(sent) < PARAMS.max_tokens
        rest = [t for o in run(core, ledger.resubmission()) for t in o.new_token_ids]
        assert sent + rest == undisturbed
        while core.has_work():
            core.step()
        assert core.check_integrity()
    finally:
        core.shutdown()
