"""Test doubles for the scheduler: a model runner that returns fixed tokens,
and a scripted connector. No torch."""

from __future__ import annotations

from tandem.scheduler.messages import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from tandem.scheduler.request import Request


class FakeRunner:
    """Tracks each request's tokens like the real runner and returns
    ``next_token(req_id, position)`` for every request whose scheduled chunk
    reaches the end of its known tokens."""

    def __init__(self, next_token=lambda rid, pos: 7) -> None:
        self.next_token = next_token
        self.state: dict[str, dict] = {}
        self.kv_output: KVConnectorOutput | None = None

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids + so.preempted_req_ids:
            self.state.pop(rid, None)
        for nr in so.scheduled_new_reqs:
            self.state[nr.req_id] = {
                "tokens": list(nr.all_token_ids),
                "blocks": list(nr.block_ids),
                "computed": nr.num_computed_tokens,
            }
        c = so.scheduled_cached_reqs
        for rid, blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            st = self.state[rid]
            st["blocks"].extend(blocks)
            assert st["computed"] == computed, (rid, st["computed"], computed)
        out = ModelRunnerOutput(kv_connector_output=self.kv_output)
        self.kv_output = None
        for rid, n in so.num_scheduled_tokens.items():
            st = self.state[rid]
            st["computed"] += n
            assert st["computed"] <= len(st["tokens"])
            out.req_ids.append(rid)
            if st["computed"] == len(st["tokens"]):
                tok = self.next_token(rid, len(st["tokens"]))
                st["tokens"].append(tok)
                out.sampled_token_ids.append([tok])
            else:
                out.sampled_token_ids.append([])
        return out


def step(sched, runner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


class FakeConnector:
    """Scheduler-side connector scripted by the test: requests with
    ``kv_transfer_params={"remote_tokens": N}`` load N tokens asynchronously;
    requests with ``{"hold": True}`` keep their blocks after finishing."""

    def __init__(self) -> None:
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.metas = 0

    def get_num_new_matched_tokens(self, request: Request, num_local: int):
        p = request.kv_transfer_params or {}
        n = p.get("remote_tokens", 0) - num_local
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external):
        self.allocs.append((request.request_id, list(block_ids), num_external))

    def build_connector_meta(self, so):
        self.metas += 1
        return {"step": self.metas}

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        p = request.kv_transfer_params or {}
        if p.get("hold") and request.status.name == "FINISHED_LENGTH_CAPPED":
            return True, {"block_ids": list(block_ids)}
        return False, None

    def cancel_send(self, request_id):
        self.cancelled.append(request_id)

    def update_connector_output(self, out):
        pass

    def has_pending_work(self):
        return False
