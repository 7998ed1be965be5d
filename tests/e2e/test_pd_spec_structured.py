"""Constrained requests speculating under prefill/decode: the prefill engine constrains the
first token, the decode engine rebuilds the matcher from the spec and P's token and
speculates (n-gram, a grammar row per verified position); real NIXL between two processes.
The split's tokens equal one engine's, greedy and seeded, and D's drafts were accepted."""

from __future__ import annotations

import json
import re

import pytest

from tandem.wire.engine_protocol import SamplingParams, StructuredOutputsParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import BASE, handoff

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip
TINY = dict(BASE, model="tiny")
SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["abab", "baba"]}, "n": {"type": "integer"}},
    "required": ["k", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pd():
    h = Harness()
    try:
        common = dict(TINY, kv_connector="nixl", kv_lease_s=3.0)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start(
            "D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=5.0, speculative_config=NGRAM,
                              **common)
        )  # fmt: skip
        yield h
    finally:
        h.close()


def test_constrained_split_speculates_and_equals_colocated(pd):
    ab = StructuredOutputsParams("regex", "[ab]+")
    js = StructuredOutputsParams("json", json.dumps(SCHEMA))
    cases = [
        ([5, 6, 7, 8] * 12, SamplingParams(max_tokens=40, min_tokens=24, temperature=0.0,
                                           structured_outputs=ab)),
        (list(range(20, 60)), SamplingParams(max_tokens=60, temperature=0.0,
                                             structured_outputs=js)),
        ([9, 10, 11] * 3, SamplingParams(max_tokens=40, min_tokens=20, temperature=0.9, seed=4,
                                         structured_outputs=ab)),
    ]  # fmt: skip
    with (
        LLM(EngineConfig.from_flat(**TINY)) as plain,
        LLM(EngineConfig.from_flat(speculative_config=NGRAM, **TINY)) as spec,
    ):
        eos = plain.engine.eos_token_id
        for i, (prompt, sp) in enumerate(cases):
            # greedy: the plain engine's tokens; seeded: what one speculating engine draws
            oracle = plain if sp.temperature == 0.0 else spec
            (want,) = oracle.generate(prompt_token_ids=[prompt], sampling_params=sp)
            toks, last, _ = handoff(pd, f"c{i}", prompt, sp)
            assert toks == want.token_ids, i
            assert last.error is None and str(last.finish_reason) == want.finish_reason, i
            text = plain.tokenizer.decode([t for t in toks if t != eos])
            if sp.structured_outputs is ab:
                assert re.fullmatch("[ab]+", text) and len(text) >= sp.min_tokens, text
            else:
                assert set(json.loads(text)) == {"k", "n"}, text
        plain.engine.check_integrity()
        spec.engine.check_integrity()
    pd.wait_idle("P")
    stats = pd.wait_idle("D").scheduler
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert pd.stats("P").scheduler.spec_decode_num_drafts == 0
