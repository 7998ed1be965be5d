"""An engine switches between the prefill and decode pools while idle
(``EngineCore.set_role``, the engine side of a pool move: cluster/disagg/pool_move.py).

- started for moves (``kv_pool_moves``), its NIXL connector serves and reads
  (role "both") whatever its pool; a prefill engine's request whose blocks are
  kept for a decode engine's read holds the switch back until it is released;
  the switched engine reports its new role in its stats and its timings;
- refused, naming ``role``: an engine not started for moves, a colocated one,
  an unknown pool; a refused switch changes nothing.
"""

from __future__ import annotations

import pytest

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.parallel.connector_hook import kv_role

GREEDY = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)


def make_engine(model: str, **kw) -> EngineCore:
    settings = dict(
        model=model,
        num_kv_blocks=32,
        kv_connector="nixl",
        kv_host="127.0.0.1",
        kv_lease_s=30.0,
        cluster_secret=None,
        role="decode",
        kv_pool_moves=True,
        engine_id="decode-7",
        epoch=3,
    )
    settings.update(kw)
    return EngineCore(EngineConfig.from_flat(**settings))


def run_to_end(core: EngineCore, request_id: str) -> list:
    outputs = []
    for _ in range(200):
        outputs += [o for o in core.step().outputs if o.request_id == request_id]
        if outputs and outputs[-1].finished:
            return outputs
    raise AssertionError(f"{request_id} did not finish in 200 steps")


def test_an_idle_engine_switches_and_a_held_handoff_holds_it_back(tiny_model_dir):
    core = make_engine(tiny_model_dir)
    try:
        assert kv_role(core.config) == "both" and core.kv_transfer_address() is not None
        core.set_role("prefill")
        assert core.stats().role == "prefill" and core.config.runtime.role == "prefill"
        # prefill work: its blocks stay held for a decode engine's read
        params = {"do_remote_decode": True}
        core.add_request(EngineRequest("p", list(range(3, 40)), GREEDY, kv_transfer_params=params))
        (last,) = run_to_end(core, "p")[-1:]
        assert last.kv_transfer_params  # what the decode engine reads from
        assert core.scheduler.num_blocks_held_for_transfer() > 0
        with pytest.raises(ValueError, match=r"^role: engine decode-7 holds 1 requests"):
            core.set_role("decode")
        assert core.stats().role == "prefill"
        core.scheduler.check_integrity(idle=False)
        core.abort(["p"])  # the decode side gave up: its blocks are free
        for _ in range(5):
            core.step()
        core.set_role("decode")
        assert core.stats().role == "decode"
        core.add_request(EngineRequest("d", [5, 6, 7], GREEDY))
        assert run_to_end(core, "d")[-1].timings.role == "decode"
        core.check_integrity()
        core.scheduler.check_integrity(idle=True)
    finally:
        core.shutdown()


@pytest.mark.parametrize(
    ("kw", "role", "named"),
    [
        ({"kv_pool_moves": False}, "prefill", "not started for pool moves"),
        ({"role": "colocated", "kv_connector": None}, "decode", "not started for pool moves"),
        ({}, "colocated", "to the prefill or decode pool"),
    ],
)
def test_refusals_name_role_and_change_nothing(tiny_model_dir, kw, role, named):
    core = make_engine(tiny_model_dir, **kw)
    try:
        before = core.config.runtime.role
        with pytest.raises(ValueError, match=named) as info:
            core.set_role(role)
        assert str(info.value).startswith("role: ")
        assert core.stats().role == before
        core.check_integrity()
    finally:
        core.shutdown()
