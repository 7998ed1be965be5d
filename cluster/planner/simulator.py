"""A discrete-event simulator of an xPyD deployment that runs the real
``scheduler.Scheduler`` (one per engine) on a virtual clock.

Each engine loops like ``EngineCore.step``: ``schedule()``, then
``update_from_output()`` with a fake ``ModelRunnerOutput``. A step's length
comes from the profile (profile.py): a step in which every scheduled request
computes one token is a decode step, ``decode_s(batch size, context tokens
the batch attends to)``; any other step costs ``prefill_s(scheduled tokens)``
(with the profile's ``service`` figures, a served step: the loop's
``step_overhead_s`` at the step's batch more, and on a step that computes
prompt tokens ``prefill_overhead_s``, ``prefill_beside_decode_s`` at the
number of streams the decode engines run when it starts, and
``prefill_after_idle_s`` at the time its engine sat idle since its previous
step ended; an engine that never stepped has been idle without end).
Each record keeps when its request reached an engine and when the step that
first computed its prompt started (``metrics.ttft_parts``).
The runner's sampled token is a constant (``ignore_eos``: a request stops at
its trace length). Disaggregation is modelled as Tandem runs it
(cluster/disagg/orchestration.py): the prefill engine computes the prompt
with ``max_tokens=1``, its sampled token is the request's first token
(streamed to the client at once: TTFT ends there) and it keeps the blocks
(``held_for_send``); the decode engine, chosen least-loaded when the prefill
ends, admits prompt + first token for the other ``output_len - 1`` tokens,
with the prompt's tokens to load (``WAITING_FOR_REMOTE_KVS``). The read
finishes ``handoff_s(tokens)`` after its blocks were allocated: then the
decode engine computes the first token's KV (sampling the second token) and
the prefill engine frees its copy. A request of one output token never goes
to a prefill engine (the gateway does not split it): a decode engine
computes it whole. Arrivals go to the prefill engine with the fewest prompt
tokens left to compute. Nothing depends on wall time or hash order: a
workload gives one result.

With the profile's ``host`` section (engines sharing a host's cores,
contention.py) a step's cost is its solo work, not its length: the engines'
steps and the serving path's per-token CPU share the cores by processor
sharing, and every step's end is computed again whenever a step starts or
ends.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from tandem.cluster.planner.contention import CpuShare
from tandem.cluster.planner.profile import Profile
from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.messages import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.scheduler.scheduler import Scheduler
from tandem.wire.engine_protocol import SamplingParams

SAMPLED_TOKEN = 1


@dataclass
class SimRequest:
    arrival_s: float
    prompt: list[int]
    output_len: int


@dataclass
class _Record:
    arrival_s: float
    output_len: int
    token_times: list[float] = field(default_factory=list)
    error: str = ""
    # where its first token's time went (metrics.ttft_parts): when it reached an
    # engine (arrival + the serving path's latency) and when the step that first
    # computed its prompt started
    entry_s: float = 0.0
    first_step_s: float | None = None


class _SimConnector:
    """The scheduler-side KV connector seam, on the virtual clock."""

    def __init__(self, sim: Simulator, engine: int, profile: Profile) -> None:
        self.sim, self.engine, self.profile = sim, engine, profile

    def get_num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if "sim_prefill_engine" not in params:
            return 0, False
        n = request.num_tokens - 1 - num_local
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external: int):
        params = request.kv_transfer_params or {}
        if "sim_prefill_engine" not in params:
            return
        # the reading (decode) engine's transfer figures
        done_s = self.sim.now_s + (self.profile.handoff_s(num_external) if num_external else 0)
        rid = request.request_id
        if num_external:
            self.sim.transfer_done(done_s, self.engine, rid, recving=True)
        # the prefill engine frees its copy when the (first) read ends; a stream
        # migrated off a moving engine (elastic.py) has no prefill engine (None)
        if params["sim_prefill_engine"] is not None and not params.get("sim_read"):
            self.sim.transfer_done(
                done_s, params["sim_prefill_engine"], params["sim_prefill_id"], False
            )
        params["sim_read"] = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        hold = (request.kv_transfer_params or {}).get("sim_hold")
        if hold and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            return True, {"sim_prefill_engine": self.engine, "sim_prefill_id": request.request_id}
        return False, None

    def cancel_send(self, request_id: str) -> None:
        pass

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        pass

    def has_pending_work(self) -> bool:
        return False


class _Engine:
    def __init__(
        self, sim: Simulator, index: int, config: SchedulerConfig, profile: Profile | None = None
    ) -> None:
        self.index = index
        self.profile = profile or sim.profile  # its step costs
        self.sched = Scheduler(
            config, _SimConnector(sim, index, self.profile), engine_id=f"sim-{index}"
        )
        self.busy_until: float | None = None
        self.step_start_s = 0.0
        self.idle_since: float | None = None  # its last step's end (None: never stepped)
        host = self.profile.host or sim.profile.host
        self.threads = host.engine_threads if host is not None else 1.0
        self.step: SchedulerOutput | None = None
        self.num_steps = 0  # steps started, the latest one's length and tokens (stats)
        self.last_step_s = 0.0
        self.last_step_tokens = 0
        self.recving: list[str] = []
        self.sending: list[str] = []

    def deliver_transfers(self) -> None:
        if not (self.recving or self.sending):
            return
        kv = KVConnectorOutput(finished_recving=self.recving, finished_sending=self.sending)
        self.recving, self.sending = [], []
        self.sched.update_from_output(SchedulerOutput(), ModelRunnerOutput(kv_connector_output=kv))

    def prompt_tokens_left(self) -> int:
        return sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for r in self.sched.requests.values()
            if not r.is_finished
        )

    def num_unfinished(self) -> int:
        s = self.sched
        return len(s.running) + len(s.waiting) + len(s.waiting_for_remote)


class Simulator:
    """``Simulator(profile, num_prefill, num_decode).run(requests)`` -> one
    record per request. ``decode_profile``: the decode pool's engines when they differ
    from the prefill pool's (another tensor-parallel size); each pool's
    schedulers take its profile's limits, and a handoff costs what the
    reading decode engine's profile says."""

    def __init__(
        self,
        profile: Profile,
        num_prefill: int,
        num_decode: int,
        scheduler_overrides: dict[str, Any] | None = None,
        decode_profile: Profile | None = None,
    ) -> None:
        if num_prefill < 1:
            raise ValueError(f"--prefill must be >= 1, got {num_prefill}")
        if num_decode < 1:
            raise ValueError(f"--decode must be >= 1, got {num_decode}")
        self.profile = profile
        self.decode_profile = decode_profile or profile
        self.config = config = _scheduler_config(profile, scheduler_overrides)
        dconfig = config
        if decode_profile is not None:
            dconfig = _scheduler_config(decode_profile, scheduler_overrides)
        self.prefill = [_Engine(self, i, config) for i in range(num_prefill)]
        self.decode = [
            _Engine(self, num_prefill + i, dconfig, self.decode_profile) for i in range(num_decode)
        ]
        self.engines = self.prefill + self.decode
        self.now_s = 0.0
        self.arrivals_left = 0  # requests of the run not arrived yet
        self._transfers: list[tuple[float, int, int, str, bool]] = []
        self._seq = 0
        host = profile.host
        # engines sharing the host's cores (None: each has a device of its own)
        self.share = CpuShare(host.cores, host.background_cores) if host is not None else None
        self.path_until: float | None = None  # the serving path's per-token backlog ends
        self.engine_cpu_s = 0.0  # the engines' solo work (threads x step), for the stats
        self._records: list[_Record] = []

    def transfer_done(self, at_s: float, engine: int, rid: str, recving: bool) -> None:
        self._seq += 1
        heapq.heappush(self._transfers, (at_s, self._seq, engine, rid, recving))

    def run(self, requests: list[SimRequest]) -> list[_Record]:
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
        # a request reaches an engine the serving path's latency after the client sent it
        entry = [r.arrival_s + self.profile.request_latency_s for r in requests]
        records = [_Record(r.arrival_s, r.output_len, entry_s=e) for r, e in zip(requests, entry)]
        self._records = records
        live: dict[str, int] = {}
        next_arrival = 0
        inf = float("inf")
        while True:
            self.arrivals_left = len(order) - next_arrival
            t = min(
                entry[order[next_arrival]] if next_arrival < len(order) else inf,
                min((e.busy_until for e in self.engines if e.busy_until is not None), default=inf),
                self._transfers[0][0] if self._transfers else inf,
                self.next_tick_s(),
                self.path_until if self.path_until is not None else inf,
            )
            if t == inf:
                break
            self.now_s = t
            if self.share is not None:
                self.share.advance(t)
            for e in self.engines:  # 1. steps that end now
                if e.busy_until is not None and e.busy_until <= t:
                    self._finish_step(e, t, records, live)
            while self._transfers and self._transfers[0][0] <= t:  # 2. handoffs that end now
                _, _, idx, rid, recving = heapq.heappop(self._transfers)
                (self.engines[idx].recving if recving else self.engines[idx].sending).append(rid)
            while next_arrival < len(order) and entry[order[next_arrival]] <= t:
                i = order[next_arrival]  # 3. arrivals
                next_arrival += 1
                self._admit_prefill(i, requests[i], records)
            self.on_tick(t, records)  # 4. (elastic pools) the planner's round
            for e in self.engines:  # 5. idle engines start a step
                if e.busy_until is None:
                    e.deliver_transfers()
                    self._start_step(e, t)
            if self.share is not None:  # 6. the cores' new shares: when each job ends
                self._reshare()
        stuck = [rid for rid in live if not records[live[rid]].error]
        stuck += [e.sched.engine_id for e in self.engines if e.sched.has_unfinished_requests()]
        if stuck:
            raise RuntimeError(f"simulation stalled with work left: {stuck[:5]}")
        for e in self.engines:
            e.sched.check_integrity()  # nothing leaked: every block free, nothing tracked
        return records

    # ---- hooks for pools that change size (elastic.py) ----------------------------

    def next_tick_s(self) -> float:
        """The next time ``on_tick`` wants to run (inf: never)."""
        return float("inf")

    def on_tick(self, t: float, records: list[_Record]) -> None:
        """Called at every event time before idle engines start a step."""

    def accepting(self, pool: list[_Engine]) -> list[_Engine]:
        """The engines of ``pool`` that take new requests."""
        return pool

    # ---- steps -------------------------------------------------------------------

    def _admit_prefill(self, i: int, req: SimRequest, records: list[_Record]) -> None:
        if req.output_len <= 1:  # nothing to hand off: a decode engine computes it whole
            e = min(self.accepting(self.decode), key=lambda x: (x.num_unfinished(), x.index))
            sp = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
            try:
                e.sched.add_request(Request(f"d{i}", req.prompt, sp, arrival_time=req.arrival_s))
            except ValueError as exc:
                records[i].error = str(exc)
            return
        e = min(self.accepting(self.prefill), key=lambda x: (x.prompt_tokens_left(), x.index))
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        r = Request(
            f"p{i}",
            req.prompt,
            sp,
            arrival_time=req.arrival_s,
            kv_transfer_params={"sim_hold": True},
        )
        try:
            e.sched.add_request(r)
        except ValueError as exc:
            records[i].error = str(exc)

    def _admit_decode(
        self, i: int, prefill_engine: int, prompt: list[int], out_len: int, prefill_id: str = ""
    ) -> None:
        e = min(self.accepting(self.decode), key=lambda x: (x.num_unfinished(), x.index))
        sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
        params = {"sim_prefill_engine": prefill_engine, "sim_prefill_id": prefill_id or f"p{i}"}
        r = Request(f"d{i}", prompt, sp, arrival_time=self.now_s, kv_transfer_params=params)
        e.sched.add_request(r)  # the prefill engine accepted the same prompt

    def _start_step(self, e: _Engine, t: float) -> None:
        if not e.sched.has_unfinished_requests():
            return
        so = e.sched.schedule()
        if so.total_num_scheduled_tokens == 0:
            return  # waiting for blocks or a handoff: an event wakes it
        idle_s = t - e.idle_since if e.idle_since is not None else float("inf")
        cost = self.step_cost(e.sched, so, e.profile, idle_s)
        e.step, e.busy_until, e.step_start_s = so, t + cost, t
        for new in so.scheduled_new_reqs:  # the step computing a prompt first
            params = e.sched.requests[new.req_id].kv_transfer_params or {}
            if "sim_prefill_engine" in params:
                continue  # a decode engine's admission of a handed-off prompt
            i = int(new.req_id[1:].partition(".")[0])
            if i < len(self._records) and self._records[i].first_step_s is None:
                self._records[i].first_step_s = t
        e.num_steps += 1
        e.last_step_s, e.last_step_tokens = cost, so.total_num_scheduled_tokens
        self.engine_cpu_s += cost * e.threads
        if self.share is not None:
            self.share.add(("engine", e.index), cost, e.threads)

    def _reshare(self) -> None:
        share = self.share
        # done, or too little left to move the clock (a late time's float spacing)
        if "path" in share.jobs() and (share.done("path") or share.finish_s("path") <= share.now_s):
            share.remove("path")
        for e in self.engines:
            if e.busy_until is not None:
                e.busy_until = share.finish_s(("engine", e.index))
        self.path_until = share.finish_s("path") if "path" in share.jobs() else None

    def step_cost(
        self,
        sched: Scheduler,
        so: SchedulerOutput,
        profile: Profile | None = None,
        idle_s: float = 0.0,
    ) -> float:
        """A step's cost; ``idle_s``: how long its engine sat idle before it."""
        profile = profile or self.profile
        counts = so.num_scheduled_tokens
        if all(n == 1 for n in counts.values()):
            context = sum(sched.requests[rid].num_computed_tokens for rid in counts)
            return profile.step_s(profile.decode_s(len(counts), context), len(counts))
        decoding = self.decoding_streams() if profile.prefill_beside_decode_s else 0
        return profile.served_prefill_s(so.total_num_scheduled_tokens, decoding, idle_s)

    def decoding_streams(self) -> int:
        """Streams the decode engines are running now (what a prompt step meets)."""
        return sum(len(e.sched.running) for e in self.decode)

    def _finish_step(self, e: _Engine, t: float, records: list[_Record], live: dict) -> None:
        so, e.step, e.busy_until, e.idle_since = e.step, None, None, t
        if self.share is not None:
            self.share.remove(("engine", e.index))
            e.last_step_s = t - e.step_start_s  # its length, stretched by the others
        reqs = e.sched.requests
        rids = list(so.num_scheduled_tokens)
        sampled = [
            [SAMPLED_TOKEN]
            if rid in reqs and reqs[rid].num_computed_tokens >= reqs[rid].num_tokens
            else []
            for rid in rids
        ]
        outs = e.sched.update_from_output(
            so, ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled)
        )
        per_token = self.profile.host.cpu_per_token_s if self.share is not None else 0.0
        for out in outs.outputs:
            if per_token and out.new_token_ids:  # the gateway streams them (and the client reads)
                self.share.add("path", per_token * len(out.new_token_ids))
            i = int(out.request_id[1:].partition(".")[0])  # p<i>.m<n>: a migration's prefill
            if out.request_id[0] == "p":
                if out.finish_reason is not None:
                    # P's token is the first output token, streamed at once; D takes
                    # prompt + that token for the rest
                    records[i].token_times.extend([t] * len(out.new_token_ids))
                    req = reqs.get(out.request_id)
                    prompt = req.prompt_token_ids if req is not None else []
                    live[f"d{i}"] = i
                    left = records[i].output_len - len(records[i].token_times)
                    tokens = [*prompt, *out.new_token_ids]
                    self._admit_decode(i, e.index, tokens, left, out.request_id)
            else:
                records[i].token_times.extend([t] * len(out.new_token_ids))
                if out.finish_reason is not None:
                    live.pop(out.request_id, None)


def _scheduler_config(profile: Profile, overrides: dict[str, Any] | None) -> SchedulerConfig:
    fields = {"prefix_caching_hash_algo": "builtin", **profile.scheduler}
    fields.update(overrides or {})
    try:
        return SchedulerConfig(**fields)
    except TypeError as exc:
        raise ValueError(f"profile: scheduler: {exc}") from None
