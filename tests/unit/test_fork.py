"""Parallel sampling in the scheduler (scheduler/fork.py): one prefill, n children
sharing its full blocks, the partial block copied; exact block ids and counts."""

import pytest

from tandem.scheduler import Request, RequestStatus
from tandem.scheduler.fork import child_request_id
from tandem.wire.engine_protocol import SamplingParams
from tests.unit.fakes import FakeRunner, step
from tests.unit.test_scheduler import make, run_to_end


def add_n(s, rid, num_prompt, n, first_token=10, **sp):
    sp.setdefault("max_tokens", 3)
    tokens = list(range(first_token, first_token + num_prompt))
    r = Request(rid, tokens, SamplingParams(**sp), n=n)
    s.add_request(r)
    return r


def refs(s, block_id):
    return s.kv.pool.blocks[block_id].ref_cnt


def test_children_share_full_blocks_and_copy_the_partial_one():
    s = make(num_kv_blocks=32, block_size=4)
    r = FakeRunner(next_token=lambda rid, pos: 500 + int(rid[-1]))
    add_n(s, "p", 10, 3, seed=7)  # the parent computes 9 tokens: 2 full blocks + 1 partial
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {"p": 9}
    assert s.kv.num_free_blocks == 32 - 3 - 2  # 3 of the parent + a partial copy per extra child
    kids = [child_request_id("p", i) for i in range(3)]
    tables = [s.kv.get_block_ids(k) for k in kids]
    b0, b1, b2 = tables[0]
    assert tables[1][:2] == tables[2][:2] == [b0, b1]
    assert len({tables[0][2], tables[1][2], tables[2][2]}) == 3
    assert (refs(s, b0), refs(s, b1), refs(s, b2)) == (3, 3, 1)
    assert [s.requests[k].sampling_params.seed for k in kids] == [7, 8, 9]
    s.check_integrity(idle=False)
    # next step: the copies, then each child computes the last prompt token
    so, eo = step(s, r)
    assert so.copy_block_ids == [(b2, tables[1][2]), (b2, tables[2][2])]
    assert so.num_scheduled_tokens == dict.fromkeys(kids, 1)
    assert sorted((o.request_id, o.index, o.new_token_ids) for o in eo.outputs) == [
        ("p", 0, [500]),
        ("p", 1, [501]),
        ("p", 2, [502]),
    ]
    outs = run_to_end(s, r)
    finals = [o for o in outs["p"] if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert s.make_stats().num_prompt_tokens == 9 + 3  # the last prompt token once per child
    assert not s.forks.children


def test_prompt_ending_on_a_block_boundary_copies_nothing():
    s = make(num_kv_blocks=32, block_size=4)
    r = FakeRunner()
    add_n(s, "p", 9, 4)  # 8 tokens shared: 2 full blocks, no partial block
    step(s, r)
    assert s.kv.num_free_blocks == 32 - 2
    so, _ = step(s, r)
    assert so.copy_block_ids == []
    assert s.kv.num_free_blocks == 32 - 2 - 4  # each child's own third block
    run_to_end(s, r)


def test_abort_one_child_then_the_parent_id():
    s = make(num_kv_blocks=32, block_size=4)
    r = FakeRunner()
    add_n(s, "p", 10, 3, max_tokens=20)
    step(s, r)
    step(s, r)
    s.finish_requests(child_request_id("p", 1), RequestStatus.FINISHED_ABORTED)
    s.check_integrity(idle=False)
    assert set(s.forks.children["p"]) == {child_request_id("p", 0), child_request_id("p", 2)}
    _, eo = step(s, r)
    assert sorted(o.index for o in eo.outputs) == [0, 2]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    s.check_integrity(idle=False)
    step(s, r)
    s.check_integrity()  # idle: every block free, nothing tracked


def test_abort_while_the_parent_prefills():
    s = make(num_kv_blocks=32, block_size=4, max_num_batched_tokens=4)
    r = FakeRunner()
    add_n(s, "p", 20, 3)
    step(s, r)  # a 4-token chunk of the parent
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    step(s, r)
    s.check_integrity()


def test_children_without_room_start_as_new_requests():
    # 7 blocks: "other" takes 3, the parent 3 (9 tokens); at the fork one block is
    # free: the second child gets it for its copy, the third has none and waits
    # (its full blocks are prefix hits when it starts)
    s = make(num_kv_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=32)
    r = FakeRunner()
    add_n(s, "other", 11, 1, first_token=100, max_tokens=1)  # finishes in the fork's step
    add_n(s, "p", 10, 3, max_tokens=2)
    step(s, r)
    assert s.kv.num_free_blocks == 7 - 3 - 1 - 3 + 3
    third = s.requests[child_request_id("p", 2)]
    assert third.status == RequestStatus.WAITING and not s.kv.get_block_ids(third.request_id)
    outs = run_to_end(s, r)
    assert sorted(o.index for o in outs["p"] if o.finished) == [0, 1, 2]


def test_children_beyond_max_num_seqs_wait():
    s = make(num_kv_blocks=32, block_size=4, max_num_seqs=2)
    r = FakeRunner()
    add_n(s, "p", 10, 4, max_tokens=2)
    step(s, r)
    assert len(s.running) == 2 and len(s.waiting) == 2
    s.check_integrity(idle=False)
    outs = run_to_end(s, r)
    assert sorted(o.index for o in outs["p"] if o.finished) == [0, 1, 2, 3]


def test_one_token_prompt_forks_at_once():
    s = make()
    r = FakeRunner()
    add_n(s, "p", 1, 3)
    assert len(s.waiting) == 3 and "p" not in s.requests
    outs = run_to_end(s, r)
    assert sorted(o.index for o in outs["p"] if o.finished) == [0, 1, 2]


def test_prefill_engine_hands_off_instead_of_forking():
    s = make(num_kv_blocks=32, block_size=4)
    r = FakeRunner()
    p = Request(
        "p",
        list(range(10, 20)),
        SamplingParams(max_tokens=1),
        n=3,
        kv_transfer_params={"do_remote_decode": True},
    )
    s.add_request(p)
    _, eo = step(s, r)
    (out,) = eo.outputs
    assert (out.request_id, out.new_token_ids, str(out.finish_reason)) == ("p", [], "length")
    assert p.num_computed_tokens == 9
    step(s, r)
    s.check_integrity()


def test_full_prefix_hit_forks_without_computing():
    s = make(num_kv_blocks=32, block_size=4)
    r = FakeRunner()
    add_n(s, "warm", 9, 1, max_tokens=1)  # caches the first 2 blocks (8 tokens)
    run_to_end(s, r)
    add_n(s, "p", 9, 2)  # its 8 shared tokens are all hits
    so, _ = step(s, r)
    assert so.num_scheduled_tokens == {}
    assert len(s.forks.children["p"]) == 2
    run_to_end(s, r)


@pytest.mark.parametrize("n", [0, 129])
def test_bad_n_is_a_value_error(n):
    with pytest.raises(ValueError, match="n must be"):
        add_n(make(), "p", 4, n)


def test_parent_id_stays_in_use_while_children_run():
    s = make()
    r = FakeRunner()
    add_n(s, "p", 6, 2, max_tokens=5)
    step(s, r)
    with pytest.raises(ValueError, match="already in use"):
        add_n(s, "p", 6, 1)
    run_to_end(s, r)
