"""The router's notes for the finished-request line (cluster/routing/route_log.py)."""

from tandem.cluster.routing.route_log import RouteNotes


def test_notes_follow_the_plan_and_are_taken_once():
    notes = RouteNotes("kv-aware")
    notes.chosen("r1", "decode", "decode-1", "prefix_hit")
    notes.planned("r1", "remote_prefill")
    notes.chosen("r1", "prefill", "prefill-0", "load")
    notes.hit("r1", 64, 48)
    assert notes.take("r1") == {
        "router": "kv-aware",
        "decode_engine": "decode-1",
        "decode_reason": "prefix_hit",
        "route_reason": "remote_prefill",
        "prefill_engine": "prefill-0",
        "prefill_reason": "load",
        "predicted_hit_tokens": 64,
        "actual_hit_tokens": 48,
    }
    assert notes.take("r1") == {} and len(notes) == 0
    # a migrated attempt planned without P drops the earlier attempt's P
    notes.chosen("r2", "prefill", "prefill-0", "load")
    notes.chosen("r2", "decode", "decode-0", "load")
    notes.planned("r2", "small_miss")
    assert "prefill_engine" not in notes.take("r2")
    notes.chosen("r3", "colocated", "colocated-2", "prefix_hit")
    notes.lent("r3", "colocated-0", 48)  # a peer's host tier lent it the rest
    assert notes.take("r3") == {
        "router": "kv-aware",
        "engine": "colocated-2",
        "engine_reason": "prefix_hit",
        "route_reason": "prefix_hit",
        "tier_lender": "colocated-0",
        "tier_lent_tokens": 48,
    }


def test_notes_never_taken_are_bounded():
    notes = RouteNotes("least-load", max_notes=3)
    for i in range(10):
        notes.chosen(f"r{i}", "decode", "decode-0", "least_load")
    assert len(notes) == 3 and notes.take("r0") == {} and notes.take("r9")
