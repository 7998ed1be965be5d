"""Structured outputs in one engine on the built-in ``smollm2``: every output of the 22-schema
set (``benchmarks/structured_schemas.py``), greedy and sampled, parses and validates with
``jsonschema``; choice, regex and grammar (GBNF and Lark) outputs match; ``n > 1`` choices each
valid; a seeded request reproduces; a grammar that cannot finish within ``max_tokens`` ends with
``length``; the overlapped loop gives the synchronous loop's tokens; a spec the engine cannot
compile ends the request in error. ``check_integrity()`` after every scenario."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from benchmarks.structured_schemas import SCHEMAS
from tandem.wire.engine_protocol import EngineRequest, SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.text.tokenizer import apply_chat_template

pytestmark = pytest.mark.slow

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm():
    config = EngineConfig.from_flat(
        model="smollm2", num_kv_blocks=512, max_model_len=1024, torch_threads=1
    )
    with LLM(config) as llm:
        yield llm


def chat_ids(llm: LLM, text: str) -> list[int]:
    return apply_chat_template(llm.tokenizer, [{"role": "user", "content": text}])


def spec(kind: str, text: str = "") -> StructuredOutputsParams:
    return StructuredOutputsParams(kind, text)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    results = llm.generate(
        prompt_token_ids=[chat_ids(llm, p) for p in prompts], sampling_params=params
    )
    llm.engine.check_integrity()
    return results


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_every_schema_output_validates(llm, sampling):
    names = list(SCHEMAS)
    assert len(names) >= 20
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0 if sampling == "greedy" else 0.8,
            seed=None if sampling == "greedy" else 1000 + i,
            structured_outputs=spec("json", json.dumps(SCHEMAS[name])),
        )
        for i, name in enumerate(names)
    ]
    prompts = [f"Give me a JSON value for a '{name}' record." for name in names]
    for name, result in zip(names, run(llm, prompts, params), strict=True):
        assert result.finish_reason == "stop", (name, result.text, result.error)
        jsonschema.validate(json.loads(result.text), SCHEMAS[name])


def test_json_object_choice_regex_and_grammars(llm):
    choices = ["Paris", "London", "Berlin"]
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark = 'start: NUMBER " + " NUMBER\nNUMBER: /[1-9][0-9]?/'
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, structured_outputs=spec("json_object")
        ),
        SamplingParams(
            max_tokens=16, temperature=0, structured_outputs=spec("choice", json.dumps(choices))
        ),
        SamplingParams(
            max_tokens=32,
            temperature=0,
            structured_outputs=spec("regex", r"[A-Z][a-z]{2,8}-[0-9]{3}"),
        ),
        SamplingParams(max_tokens=32, temperature=0, structured_outputs=spec("grammar", gbnf)),
        SamplingParams(
            max_tokens=32, temperature=0.9, seed=3, structured_outputs=spec("grammar", lark)
        ),
    ]
    prompts = ["Describe a cat as JSON.", "What is the capital of France?", "Make an id.",
               "Is the sky blue?", "Add two numbers."]  # fmt: skip
    obj, choice, regex, yes_no, addition = run(llm, prompts, params)
    assert isinstance(json.loads(obj.text), dict)
    assert choice.text in choices and choice.finish_reason == "stop"
    assert re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", regex.text), regex.text
    assert re.fullmatch(r"The answer is (yes|no)\.", yes_no.text), yes_no.text
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", addition.text), addition.text
    for r in (obj, choice, regex, yes_no, addition):
        assert r.finish_reason == "stop", r


def test_parallel_choices_each_valid_and_seeded_reproducible(llm):
    schema = SCHEMAS["array_of_objects"]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
                        structured_outputs=spec("json", json.dumps(schema)))  # fmt: skip
    ids = chat_ids(llm, "List an order as JSON.")
    engine = llm.engine
    texts = {}
    for attempt in range(2):
        rid = f"n4-{attempt}"
        assert engine.add_request(EngineRequest(rid, ids, sp, n=4)) is None
        tokens: dict[int, list[int]] = {}
        finish = {}
        while engine.has_work():
            for o in engine.step().outputs:
                tokens.setdefault(o.index, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finish[o.index] = (str(o.finish_reason), o.error)
        engine.check_integrity()
        assert sorted(finish) == [0, 1, 2, 3] and all(f == ("stop", None) for f in finish.values())
        texts[attempt] = {
            i: llm.tokenizer.decode(t, skip_special_tokens=True) for i, t in tokens.items()
        }
        for text in texts[attempt].values():
            jsonschema.validate(json.loads(text), schema)
    assert texts[0] == texts[1]  # seeded: the same choices again


def test_grammar_that_cannot_finish_ends_with_length(llm):
    sp = SamplingParams(max_tokens=8, temperature=0, structured_outputs=spec("regex", "a{50}"))
    (r,) = run(llm, ["Say a."], [sp])
    assert r.finish_reason == "length" and r.text == "a" * len(r.text) and r.token_ids


def test_engine_refuses_a_spec_it_cannot_compile(llm):
    bad = [spec("regex", "[a-"), spec("json", '{"type": "nope"}'), spec("choice", "[]")]
    params = [SamplingParams(max_tokens=8, structured_outputs=s) for s in bad]
    results = run(llm, ["x", "y", "z"], params)
    for r in results:
        assert r.finish_reason == "error" and "structured_outputs" in r.error, r
    assert llm.engine.stats().structured.compile_failures_total >= 2


def test_overlapped_loop_equals_synchronous(llm):
    names = ["flat", "ref", "mixed", "enum_array"]
    params = [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=5 + i,
            structured_outputs=spec("json", json.dumps(SCHEMAS[n])),
        )  # fmt: skip
        for i, n in enumerate(names)
    ] + [SamplingParams(max_tokens=24, temperature=0.7, seed=9)]  # one unconstrained row
    prompts = [f"JSON for {n}" for n in names] + ["Tell me a story."]
    want = [r.token_ids for r in run(llm, prompts, params)]
    config = llm.engine.config.replace(async_scheduling=True)
    with LLM(config) as overlapped:
        assert overlapped.engine.overlap is not None
        got = overlapped.generate(prompt_token_ids=[chat_ids(llm, p) for p in prompts],
                                  sampling_params=params)  # fmt: skip
        overlapped.engine.check_integrity()
    assert [r.token_ids for r in got] == want


def test_migrated_constrained_stream_stays_valid_and_identical(llm):
    """A stream cut after a few tokens and resubmitted as the gateway's migration does
    (``StreamLedger.resubmission``: prompt + sent tokens) rebuilds its matcher from the spec and
    the sent tokens, and ends exactly as the uninterrupted stream."""
    from tandem.cluster.disagg.migration import StreamLedger

    schema = SCHEMAS["array_of_objects"]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=21,
                        structured_outputs=spec("json", json.dumps(schema)))  # fmt: skip
    ids = chat_ids(llm, "An order as JSON, please.")
    (whole,) = llm.generate(prompt_token_ids=[ids], sampling_params=sp)
    engine = llm.engine
    request = EngineRequest("migrating", ids, sp)
    ledger = StreamLedger(request)
    assert engine.add_request(request) is None
    while len(ledger.sent_token_ids) < 6:
        for o in engine.step().outputs:
            ledger.record(o)
    engine.abort(["migrating"])  # the engine is lost
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    moved = ledger.resubmission()
    assert moved.sampling_params.structured_outputs == sp.structured_outputs
    msgspec_moved = moved  # what travels: the spec as text, never a matcher
    assert engine.add_request(msgspec_moved) is None
    while engine.has_work():
        for o in engine.step().outputs:
            ledger.record(o)
    engine.check_integrity()
    assert ledger.sent_token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), schema)
