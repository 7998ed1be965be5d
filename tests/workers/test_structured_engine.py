"""The engine's grammar states on the tiny model (byte-level vocabulary): a constrained request
waits in ``WAITING_FOR_FSM`` while others run, never past its compile deadline (it then ends in
error), can be aborted while it waits; steps without a constrained request carry no bitmask; the
matcher interface advances by token lists and rolls back. ``check_integrity()`` after each."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from tandem.scheduler.request import RequestStatus
from tandem.wire.engine_protocol import EngineRequest, SamplingParams, StructuredOutputsParams
from tandem.workers.engine.llm import LLM
from tandem.workers.structured.backend import bitmask_width, make_backend
from tandem.workers.structured.manager import StructuredOutputManager
from tandem.workers.text.tokenizer import load_tokenizer


class GatedBackend:
    """llguidance whose compiles wait for ``gate`` (a slow grammar)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate
        self.name, self.vocab_size = inner.name, inner.vocab_size

    def compile(self, spec):
        assert self.gate.wait(30)
        return self.inner.compile(spec)

    def matcher(self, compiled):
        return self.inner.matcher(compiled)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(model=tiny_model_dir, num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def gated(llm: LLM, gate: threading.Event, timeout_s: float = 30.0) -> StructuredOutputManager:
    """Swap the engine's manager for one whose compiles wait for ``gate``."""
    engine = llm.engine
    vocab = engine.model.vocab_size

    def make():
        inner = make_backend(
            "llguidance", load_tokenizer(engine.model_path), vocab, [engine.eos_token_id]
        )
        return GatedBackend(inner, gate)

    manager = StructuredOutputManager(make, "llguidance", vocab, compile_timeout_s=timeout_s)
    engine.structured = engine.scheduler.structured = manager
    return manager


def drain(engine, outputs: dict) -> None:
    while engine.has_work():
        for o in engine.step().outputs:
            rec = outputs.setdefault(o.request_id, {"tokens": [], "finish": None, "error": None})
            rec["tokens"] += o.new_token_ids
            if o.finish_reason is not None:
                rec["finish"], rec["error"] = str(o.finish_reason), o.error


REGEX = StructuredOutputsParams("regex", "(ab){3}")


def test_waits_for_its_grammar_while_others_run(llm):
    """A flood of distinct schemas compiling does not hold back an unconstrained request: it
    runs to its end while every constrained one waits in WAITING_FOR_FSM (no timing asserted:
    the compiles are held until it finished)."""
    engine = llm.engine
    gate = threading.Event()
    saved = engine.structured
    try:
        gated(llm, gate)
        engine.add_request(EngineRequest("c", [1, 2, 3], SamplingParams(max_tokens=16, temperature=0,
                                                                       structured_outputs=REGEX)))  # fmt: skip
        flood = [f"flood-{i}" for i in range(30)]
        for i, rid in enumerate(flood):
            schema = {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer"}},
                "required": [f"k{i}"],
            }
            sp = SamplingParams(
                max_tokens=12,
                structured_outputs=StructuredOutputsParams("json", json.dumps(schema)),
            )
            engine.add_request(EngineRequest(rid, [1, 2], sp))
        engine.add_request(
            EngineRequest("u", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0))
        )
        assert engine.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_FSM
        outputs: dict = {}
        for _ in range(50):
            for o in engine.step().outputs:
                outputs.setdefault(o.request_id, []).append(o)
            if outputs.get("u") and outputs["u"][-1].finish_reason is not None:
                break
        assert "c" not in outputs  # still compiling; the unconstrained request finished
        assert engine.scheduler.requests["c"].status == RequestStatus.WAITING_FOR_FSM
        assert engine.stats().scheduler.num_waiting_reqs == 31
        engine.scheduler.check_integrity(idle=False)
        gate.set()
        rest: dict = {}
        drain(engine, rest)
        assert rest["c"]["finish"] == "stop"
        assert all(rest[rid]["finish"] in ("stop", "length") for rid in flood)
        assert llm.tokenizer.decode(rest["c"]["tokens"], skip_special_tokens=True) == "ababab"
        engine.check_integrity()
    finally:
        gate.set()
        engine.structured.shutdown()
        engine.structured = engine.scheduler.structured = saved


def test_compile_deadline_ends_the_request_in_error(llm):
    engine = llm.engine
    gate = threading.Event()
    saved = engine.structured
    try:
        gated(llm, gate, timeout_s=0.2)
        sp = SamplingParams(max_tokens=8, structured_outputs=REGEX)
        engine.add_request(EngineRequest("slow", [1, 2], sp))
        outputs: dict = {}
        drain(engine, outputs)  # returns: the deadline ends the wait
        assert outputs["slow"]["finish"] == "error"
        assert "did not compile within" in outputs["slow"]["error"]
        assert engine.stats().structured.compile_failures_total == 1
        engine.check_integrity()
    finally:
        gate.set()
        engine.structured.shutdown()
        engine.structured = engine.scheduler.structured = saved


def test_abort_while_waiting_for_the_grammar(llm):
    engine = llm.engine
    gate = threading.Event()
    saved = engine.structured
    try:
        gated(llm, gate)
        sp = SamplingParams(max_tokens=8, structured_outputs=REGEX)
        engine.add_request(EngineRequest("gone", [1, 2], sp))
        engine.step()
        engine.abort(["gone"])
        engine.check_integrity()
        assert not engine.has_work()
    finally:
        gate.set()
        engine.structured.shutdown()
        engine.structured = engine.scheduler.structured = saved


def test_unconstrained_steps_carry_no_bitmask(llm, monkeypatch):
    engine = llm.engine
    seen = []
    schedule = engine.scheduler.schedule

    def recording():
        so = schedule()
        seen.append(so.grammar_bitmask)
        return so

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    sp = SamplingParams(max_tokens=3, structured_outputs=REGEX)
    engine.add_request(EngineRequest("constrained", [1, 2, 3], sp))
    drain(engine, {})
    masks = [b for b in seen if b is not None]
    assert len(masks) == 3 and all(b.req_ids == ["constrained"] for b in masks)
    seen.clear()
    engine.add_request(EngineRequest("plain", [1, 2, 3], SamplingParams(max_tokens=3)))
    drain(engine, {})
    assert seen and all(b is None for b in seen)
    engine.check_integrity()


def test_matcher_advances_by_token_lists_and_rolls_back(llm):
    tok = llm.tokenizer
    vocab = llm.engine.model.vocab_size
    backend = make_backend("llguidance", tok, vocab, [llm.engine.eos_token_id])
    matcher = backend.matcher(backend.compile(REGEX))
    a, b = (
        tok.encode("a", add_special_tokens=False)[0],
        tok.encode("b", add_special_tokens=False)[0],
    )
    bitmask = np.zeros((2, bitmask_width(vocab)), dtype=np.int32)

    def allowed(row: int) -> list[int]:
        return [t for t in range(vocab) if bitmask[row, t // 32] >> (t % 32) & 1]

    assert matcher.advance([a, b, a]) == 3
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(0) == [b]
    assert matcher.advance([b, b]) == 1  # the second b is refused
    matcher.rollback(2)  # back to "ab"
    matcher.fill_bitmask(bitmask, 1)
    assert allowed(1) == [a]
    assert matcher.advance([a, b, a, b, llm.engine.eos_token_id]) == 5
    assert matcher.is_terminated()


def test_grammar_mask_rows_against_a_bit_by_bit_reference():
    import torch

    from tandem.scheduler.messages import GrammarBitmask
    from tandem.workers.sampling.grammar_mask import GrammarRows, allowed_tokens, apply_grammar_mask

    vocab = 300  # not a multiple of 32: the last word's high bits are past the vocabulary
    rng = np.random.default_rng(1)
    words = rng.integers(-(2**31), 2**31, (3, bitmask_width(vocab)), dtype=np.int64).astype(
        np.int32
    )
    ref = torch.tensor(
        [[bool(words[r, t // 32] >> (t % 32) & 1) for t in range(vocab)] for r in range(3)]
    )
    assert torch.equal(allowed_tokens(words, vocab, torch.device("cpu")), ref)
    padded = allowed_tokens(words[:, :5], vocab, torch.device("cpu"))  # a model vocab past the mask
    assert not padded[:, 160:].any() and torch.equal(padded[:, :160], ref[:, :160])
    # rows "b", "c", "d" sample; the step's bitmask names c, d and one that did not sample
    step = GrammarBitmask(["c", "x", "d"], words.tobytes())
    rows = GrammarRows.from_step(step, ["b", "c", "d"])
    assert rows.rows == [1, 2]
    logits = torch.randn(3, vocab)
    masked = apply_grammar_mask(logits, rows)
    assert torch.equal(masked[0], logits[0])
    for row, k in ((1, 0), (2, 2)):
        assert torch.equal(torch.isinf(masked[row]), ~ref[k])
        assert torch.equal(masked[row][ref[k]], logits[row][ref[k]])
    assert GrammarRows.from_step(None, ["a"]) is None


def test_min_tokens_with_a_grammar(llm):
    """min_tokens holds EOS back while the grammar can go on; a grammar that has ended still
    ends (never an empty mask)."""
    engine = llm.engine
    go_on = SamplingParams(max_tokens=20, min_tokens=6, temperature=0,
                           structured_outputs=StructuredOutputsParams("regex", "[ab]+"))  # fmt: skip
    ended = SamplingParams(max_tokens=20, min_tokens=12, temperature=0, structured_outputs=REGEX)
    a, b = llm.generate(prompt_token_ids=[[1, 2, 3], [1, 2, 3]], sampling_params=[go_on, ended])
    engine.check_integrity()
    assert a.finish_reason in ("stop", "length") and a.error is None
    assert len(a.token_ids) >= 6 and set(a.text) <= {"a", "b"}
    assert (b.finish_reason, b.text, b.error) == ("stop", "ababab", None)
    assert b.token_ids[-1] == engine.eos_token_id and len(b.token_ids) == 7


def test_overlapped_loop_constrains_every_step(tiny_model_dir):
    """--async-scheduling: a constrained request decodes on every step (its mask waits for the
    token in flight: the loop applies that step first) and gives the synchronous tokens."""
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, structured_outputs=StructuredOutputsParams("regex", "[a-c]{4,9}")),
        SamplingParams(max_tokens=12, temperature=0.8, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, structured_outputs=REGEX),
    ]  # fmt: skip
    results = {}
    for overlap in (False, True):
        with LLM(
            model=tiny_model_dir, num_kv_blocks=64, max_model_len=256, async_scheduling=overlap
        ) as llm:
            assert (llm.engine.overlap is not None) == overlap
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
            llm.engine.check_integrity()
            results[overlap] = [(r.token_ids, r.finish_reason) for r in outs]
            steps = llm.engine.num_steps
    assert results[True] == results[False]
    assert results[True][2][1] == "stop" and len(results[True][2][0]) == 7  # ababab + EOS
    assert steps <= 12 + 4  # every step decodes the constrained rows too (no every-other step)


def test_compile_timeout_flag_is_checked():
    from tandem.workers.config import EngineConfig

    with pytest.raises(ValueError, match="structured_outputs_compile_timeout_s"):
        EngineConfig.from_flat(structured_outputs_compile_timeout_s=0)
