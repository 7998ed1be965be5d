"""An engine's stats carry its latest step's length and the tokens it
computed (``EngineStats.last_step_num_tokens``): the sla planner compares the
two with its profile to correct the prefill speed it plans with."""

from __future__ import annotations

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.engine.llm import LLM


def test_stats_carry_the_latest_steps_tokens(tiny_model_dir):
    with LLM(model=tiny_model_dir, num_kv_blocks=64, max_model_len=256) as llm:
        engine = llm.engine
        assert engine.stats().last_step_num_tokens == 0  # no step yet
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for i in range(2):
            assert engine.add_request(EngineRequest(f"r{i}", [5 + i] * 6, params)) is None
        engine.step()  # both prompts: 2 x 6 tokens
        stats = engine.stats()
        assert stats.last_step_num_tokens == 12 and stats.last_step_s > 0
        engine.step()  # one decode token each
        assert engine.stats().last_step_num_tokens == 2
        while engine.has_work():
            engine.step()
        assert engine.check_integrity()
