"""Constrained requests speculate (issues #27 and #26): drafts are cut where the grammar
refuses one, each verified position is masked with its own grammar row, and only the tokens
verification keeps advance the matcher.

- the manager's rows for a request with drafts equal the rows of a matcher advanced token by
  token, and its tentative walks leave the matcher where it was (an EOS after the grammar
  ended included);
- greedy constrained requests with n-gram drafts give the plain engine's tokens exactly, on
  ``tiny`` (regex, JSON schema) and on ``smollm2`` with prompts the output copies, and the
  drafts were accepted (the speculative stats say so);
- a seeded sampled constrained request gives the same valid output alone and in a batch;
- a migrated constrained stream speculates on the new engine and ends with the same tokens;
- the step's bitmask rows line up with the sampler's and the verifier's logits.

``check_integrity()`` after every scenario (``run`` does it).
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from tandem.scheduler.request import Request
from tandem.wire.engine_protocol import SamplingParams, StructuredOutputsParams
from tandem.workers.structured.backend import bitmask_width, make_backend
from tandem.workers.structured.manager import StructuredOutputManager
from tandem.workers.text.tokenizer import load_tokenizer
from tests.workers.test_spec_decode import NGRAM, prompts, run

SCHEMA = {
    "type": "object",
    "properties": {
        "k": {"type": "string", "maxLength": 12},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["ab", "ba"]}, "maxItems": 6},
    },
    "required": ["k", "n", "tags"],
    "additionalProperties": False,
}
AB = StructuredOutputsParams("regex", "[ab]+")
JSON = StructuredOutputsParams("json", json.dumps(SCHEMA))


def constrained(so: StructuredOutputsParams, max_tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=so, **kw)


def texts(engine, outputs: list[list[list[int]]]) -> list[str]:
    """Each request's first choice as text, without its final EOS."""
    tok = load_tokenizer(engine.model_path)
    eos = engine.eos_token_id
    return [tok.decode([t for t in out[0] if t != eos]) for out in outputs]


def test_draft_rows_equal_a_matcher_walked_token_by_token(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    vocab = 262
    eos = tok.eos_token_id

    def backend():
        return make_backend("llguidance", tok, vocab, [eos])

    manager = StructuredOutputManager(backend, "llguidance", vocab)
    so = StructuredOutputsParams("regex", "(ab){2}c")
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=9, structured_outputs=so),
                  eos_token_id=eos)  # fmt: skip
    manager.submit(req)
    while not manager.poll(req):
        manager._submitted["r"][0].result(timeout=30)
    a, b, c = (tok.encode(x, add_special_tokens=False)[0] for x in "abc")

    def allowed(raw: bytes, rows: int) -> list[list[int]]:
        words = np.frombuffer(raw, dtype=np.int32).reshape(rows, bitmask_width(vocab))
        return [[t for t in range(vocab) if words[r, t // 32] >> (t % 32) & 1] for r in range(rows)]

    # a draft the grammar refuses, and all after it, are cut; the matcher does not move
    assert manager.num_allowed_drafts(req, [a, b, b, a]) == 2
    assert manager.num_allowed_drafts(req, [b]) == 0
    req.spec_token_ids = [a, b, a]
    assert allowed(manager.bitmask([req]), 4) == [[a], [b], [a], [b]]
    req.spec_token_ids = []
    assert allowed(manager.bitmask([req]), 1) == [[a]]  # rolled back to the start
    # the accepted tokens only advance it: "a b" kept of three drafts
    assert manager.accept(req, [a, b]) == 2
    req.spec_token_ids = [a, b, c, eos]  # c ends the grammar, EOS after it is accepted
    assert manager.num_allowed_drafts(req, req.spec_token_ids) == 4
    assert allowed(manager.bitmask([req]), 5) == [[a], [b], [c], [eos], [eos]]
    req.spec_token_ids = []
    assert allowed(manager.bitmask([req]), 1) == [[a]]
    manager.remove(req)
    manager.check_integrity(set())
    manager.shutdown()


def test_greedy_constrained_requests_speculate_with_the_plain_tokens():
    """n-gram drafts on the random ``tiny`` model: a grammar with a small alphabet repeats
    itself, so drafts are proposed, cut by the grammar, accepted and rejected; min_tokens
    holds EOS back row by row (a draft EOS before ``min_tokens`` is never kept)."""
    requests = [
        (prompts()[0], constrained(AB, min_tokens=20), 1),
        (prompts()[1], constrained(AB, min_tokens=8), 1),
        (prompts()[2], constrained(JSON, 60), 1),
        (prompts()[3], constrained(JSON, 60, ignore_eos=True), 1),
    ]
    plain, plain_reasons, _ = run(requests, None)
    spec, reasons, engine = run(requests, NGRAM)
    assert spec == plain and reasons == plain_reasons
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_drafts > 0
    out = texts(engine, spec)
    assert re.fullmatch("[ab]+", out[0]) and len(out[0]) >= 20
    assert re.fullmatch("[ab]+", out[1]) and len(out[1]) >= 8
    for text in out[2:]:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_seeded_sampled_constrained_request_is_the_same_in_any_batch():
    """Rejection sampling against the masked rows: the request's tokens are a function of
    its seed and positions, not of its batch mates (a large budget: the batch never limits
    its drafts), and every output is valid."""
    sampled = SamplingParams(max_tokens=40, temperature=0.9, seed=7, min_tokens=16,
                             structured_outputs=StructuredOutputsParams("regex", "[abc]+"))  # fmt: skip
    others = [
        (prompts(3)[0], constrained(AB, min_tokens=12), 1),
        (prompts(3)[2], SamplingParams(max_tokens=30, temperature=0.8, seed=3), 1),
        (
            prompts(3)[1],
            SamplingParams(max_tokens=120, temperature=0.7, seed=5, structured_outputs=JSON),
            1,
        ),  # fmt: skip
    ]
    target = (prompts()[1], sampled, 1)
    budget = dict(max_num_batched_tokens=256)
    alone, _, engine = run([target], NGRAM, **budget)
    drafted = engine.scheduler.spec.stats.num_drafts
    batched, reasons, engine = run([others[0], target, *others[1:]], NGRAM, **budget)
    assert batched[1] == alone[0]
    assert drafted > 0 and engine.scheduler.spec.stats.num_accepted_tokens > 0
    out = texts(engine, batched)
    assert re.fullmatch("[abc]+", out[1]) and len(out[1]) >= 16
    assert re.fullmatch("[ab]+", out[0])
    assert reasons[3] == ["stop"], out[3]
    jsonschema.validate(json.loads(out[3]), SCHEMA)


@pytest.mark.slow
def test_smollm2_copying_prompts_speculate_with_the_plain_tokens():
    """The real model copying a record from its prompt under a JSON schema and a regex: the
    n-gram drafts are mostly accepted, and the output is the plain engine's."""
    from tandem.workers.engine.llm import LLM
    from tandem.workers.text.tokenizer import apply_chat_template

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "city": {"type": "string"},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["name", "city", "age", "tags"],
        "additionalProperties": False,
    }
    record = {"name": "Alice Johnson", "city": "San Francisco", "age": 34,
              "tags": ["engineer", "runner", "chess"]}  # fmt: skip
    code = r"[A-Z]{3}(-[0-9]{4}-[A-Z]{3}){3}"
    asks = [
        f"Copy this JSON object exactly, nothing else: {json.dumps(record, separators=(',', ':'))}",
        "Repeat this code exactly: ABC-1234-XYZ-5678-ABC-1234-XYZ",
    ]
    params = [
        constrained(StructuredOutputsParams("json", json.dumps(schema)), 80),
        constrained(StructuredOutputsParams("regex", code), 40),
    ]
    spec_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4}  # fmt: skip
    results = {}
    before = torch.get_num_threads()
    try:
        for speculative in (None, spec_config):
            with LLM(model="smollm2", num_kv_blocks=256, max_model_len=1024, torch_threads=1,
                     speculative_config=speculative) as llm:  # fmt: skip
                ids = [apply_chat_template(llm.tokenizer, [{"role": "user", "content": a}])
                       for a in asks]  # fmt: skip
                outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
                llm.engine.check_integrity()
                results[speculative is None] = [(o.token_ids, o.finish_reason) for o in outs]
                if speculative is not None:
                    stats = llm.engine.scheduler.spec.stats
                    assert stats.num_accepted_tokens > stats.num_draft_tokens // 2 > 0
                    texts_ = [o.text for o in outs]
    finally:
        torch.set_num_threads(before)
    assert results[False] == results[True]
    assert json.loads(texts_[0]) == record
    assert re.fullmatch(code, texts_[1]) and results[True][1][1] == "stop"


def test_verified_rows_line_up_with_the_verifiers_logits():
    """A step's bitmask names a request once per row: plain sampled rows go to the sampler
    (``from_step``), a drafting request's ``1 + k`` rows to the verifier (``for_verified``)."""
    from tandem.scheduler.messages import GrammarBitmask
    from tandem.workers.sampling.grammar_mask import GrammarRows

    words = np.arange(5 * 2, dtype=np.int32).reshape(5, 2)
    step = GrammarBitmask(["x", "s", "s", "s", "y"], words.tobytes())
    plain = GrammarRows.from_step(step, ["y", "x"])  # the sampler's rows: y then x
    assert plain.rows == [1, 0] and plain.bitmask.tolist() == [words[0].tolist(), words[4].tolist()]
    # verifier rows: s (2 drafts: 3 rows), z (unconstrained, 1 draft: no grammar row)
    verified = GrammarRows.for_verified(step, ["s", "z"], [3, 2])
    assert verified.rows == [0, 1, 2] and verified.bitmask.tolist() == words[1:4].tolist()
    assert GrammarRows.for_verified(step, ["z"], [2]) is None
    with pytest.raises(ValueError, match="3 grammar rows for 2 positions"):
        GrammarRows.for_verified(step, ["s"], [2])


def test_a_migrated_constrained_stream_speculates_on_with_the_same_tokens():
    """A constrained stream cut after a few tokens and resubmitted as the gateway's migration
    does (prompt + sent tokens): the new engine rebuilds the matcher from the spec and the
    sent tokens, drafts again, and ends with the undisturbed run's tokens (greedy: the plain
    engine's), a valid output."""
    from tandem.wire.engine_protocol import EngineRequest
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore
    from tests.workers.spec_migration import migrate_mid_stream

    prompt, sp = prompts()[0], constrained(AB, min_tokens=24)
    plain, _, _ = run([(prompt, sp, 1)], None)

    def speculating_engine() -> EngineCore:
        return EngineCore(EngineConfig.from_flat(model="tiny", speculative_config=NGRAM, block_size=8,
                                       num_kv_blocks=64, max_num_batched_tokens=32))  # fmt: skip

    moved = migrate_mid_stream(speculating_engine, EngineRequest("migrating", prompt, sp), 9)
    second, ledger = moved.second, moved.ledger
    assert second.scheduler.spec.stats.num_accepted_tokens > 0  # it speculated after the move
    assert ledger.sent_token_ids == plain[0][0]
    assert re.fullmatch("[ab]+", texts(second, [[ledger.sent_token_ids]])[0])
