"""The simulator with the running planner in the loop: pools that change size.

``ElasticSimulator`` is ``Simulator`` (simulator.py) plus, every
``interval_s`` of virtual time, one round of a planner (autoscale.py) fed
the same ``Observation`` the service builds: per engine its running and
waiting requests, KV usage, steps and last step time; the cumulative
arrivals and prompt tokens, and the requests that ended with their output
tokens. Its decisions apply as the service applies them, with two
simplifications:

    scale out   a new engine (a new real Scheduler) takes requests
                ``cold_start_s`` later (the service: actor start, model load,
                registry exchange; benchmarks/scaling.py measures it)
    scale in    the newest engine takes no new request and leaves once it holds
                none: its streams finish in place (the service migrates them;
                what moves is the same work, minus the migration's recompute)
                and its slot is free at once (the service's drain takes well
                under a second: benchmarks/scaling.py)

    move        (``switch_s`` given: a planner asking for pool moves, moves.py)
                the engine takes no new request in its pool; a decode engine's
                streams migrate once its step and its handoffs in flight end,
                as the service's drain migrates them (cluster/disagg/
                migration.py): a context of at least
                ``migration_handoff_min_tokens`` is prefilled again by a
                prefill engine (which samples the next token) and handed off
                to the least loaded other decode engine, a shorter one is
                recomputed there; either continues token for token. A
                prefill engine finishes what it holds.
                Then it serves in the other pool ``switch_s`` later (the
                drain's and the re-registration's fixed cost: an input, from
                measured figures, benchmarks/planner.py), with no cold start

``slots`` caps prefill + decode engines (starting ones count, leaving ones do
not): scale-ins apply first, then a pool grows only into free slots.

``watch_interval_s`` (> 0, a planner with ``watch``: the sla planner) looks
between rounds as the runner does (watch.py): decisions only on a measured
breach, and the first round (the sla planner's baseline) comes at the first
event instead of an interval in. The engines' figures are the ones the
gateway holds: steps so far, the latest step's length and tokens, the
context as KV usage x the engine's tokens.
"""

from __future__ import annotations

from typing import Any

from tandem.cluster.planner.autoscale import EngineSample, Observation
from tandem.cluster.planner.moves import plan
from tandem.cluster.planner.profile import Profile
from tandem.cluster.planner.simulator import Simulator, _Engine, _Record
from tandem.scheduler.request import Request, RequestStatus
from tandem.wire.engine_protocol import SamplingParams


class ElasticSimulator(Simulator):
    def __init__(
        self,
        profile: Profile,
        num_prefill: int,
        num_decode: int,
        planner: Any,
        *,
        interval_s: float,
        cold_start_s: float,
        slots: int,
        scheduler_overrides: dict[str, Any] | None = None,
        watch_interval_s: float = 0.0,
        switch_s: float | None = None,
        migration_handoff_min_tokens: int = 256,  # the service's MigrationPolicy default
    ) -> None:
        super().__init__(profile, num_prefill, num_decode, scheduler_overrides)
        if num_prefill + num_decode > slots:
            raise ValueError(f"{num_prefill}P{num_decode}D does not fit {slots} slots")
        if switch_s is not None and switch_s < 0:
            raise ValueError(f"switch_s must be >= 0, got {switch_s}")
        self.switch_s = switch_s  # None: engines cannot move between pools
        self.moving: dict[int, tuple[int, str]] = {}  # leaving index -> (joining index, from)
        self.moves: list[tuple[float, str, str]] = []  # (time, from, to) per move asked for
        self.migrated = 0  # streams moved off a moving decode engine
        self.reprefilled = 0  # of them, continued by a fresh prefill handoff
        self.handoff_min_tokens = migration_handoff_min_tokens
        self.planner = planner
        self.interval_s = interval_s
        self.cold_start_s = cold_start_s
        self.slots = slots
        self.joins_at: dict[int, float] = {}  # engine index -> when it takes requests
        self.leaving: set[int] = set()  # engine indexes that take no new request
        self.gone: set[int] = set()  # left: hold nothing, never step again
        self.arrived = self.prompt_tokens = self.finished = self.output_tokens = 0
        self.requested_output_tokens = 0
        self.watch_interval_s = watch_interval_s if hasattr(planner, "watch") else 0.0
        # the next round; with a watch the first (the baseline) at the first event, as
        # the runner does
        self._next_tick = 0.0 if self.watch_interval_s else interval_s
        self._next_watch = self.watch_interval_s or float("inf")
        self._open: set[int] | None = None  # requests not ended yet
        self.sizes: list[tuple[float, int, int]] = [(0.0, num_prefill, num_decode)]
        self.decisions: list[Any] = []

    # ---- Simulator hooks -----------------------------------------------------------

    def accepting(self, pool: list[_Engine]) -> list[_Engine]:
        now = self.now_s
        ready = [
            e
            for e in pool
            if e.index not in self.leaving and self.joins_at.get(e.index, 0.0) <= now
        ]
        return ready or self._members(pool)  # all still starting: queue on one

    def next_tick_s(self) -> float:
        busy = any(e.sched.has_unfinished_requests() for e in self.engines)
        due = min(self._next_tick, self._next_watch)
        return due if self.arrivals_left or busy else float("inf")

    def _admit_prefill(self, i: int, req: Any, records: list[_Record]) -> None:
        self.arrived += 1
        self.prompt_tokens += len(req.prompt)
        self.requested_output_tokens += req.output_len
        super()._admit_prefill(i, req, records)

    def on_tick(self, t: float, records: list[_Record]) -> None:
        if self.moving:
            self._progress_moves(t)
        if t < min(self._next_tick, self._next_watch):
            return
        round_due = t >= self._next_tick
        if round_due:
            self._next_tick = t + self.interval_s
        if self.watch_interval_s:
            self._next_watch = t + self.watch_interval_s
        self._count_ended(records)
        for e in self.engines:  # leavers that hold nothing are gone
            if e.index in self.leaving and not e.sched.has_unfinished_requests():
                self.gone.add(e.index)
        obs = self._observe(t)
        decisions = self.planner.decide(obs) if round_due else self.planner.watch(obs)
        if not decisions:
            return
        self.decisions += decisions
        for kind, pool, arg in plan(decisions, self.switch_s is not None):  # free slots first
            if kind == "move":
                self._move(pool, arg, t)
            else:
                self._resize(pool, arg)
        self.sizes.append((t, len(self._members(self.prefill)), len(self._members(self.decode))))

    # ---- the planner's view and its resizes ---------------------------------------

    def _members(self, pool: list[_Engine]) -> list[_Engine]:
        """Engines of the pool that count as its size (not leaving)."""
        return [e for e in pool if e.index not in self.leaving]

    def _observe(self, t: float) -> Observation:
        pools = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            samples = []
            for e in self._members(pool):
                s = e.sched
                stats = s.make_stats()
                tokens = self.config.num_kv_blocks * self.config.block_size
                samples.append(
                    EngineSample(
                        engine_id=f"{role}-{e.index}",
                        ready=self.joins_at.get(e.index, 0.0) <= t,
                        running=stats.num_running_reqs,
                        waiting=stats.num_waiting_reqs + stats.num_waiting_for_remote_kvs,
                        kv_usage=stats.kv_cache_usage,
                        num_steps=e.num_steps,
                        last_step_s=e.last_step_s,
                        last_step_tokens=e.last_step_tokens,
                        context_tokens=stats.kv_cache_usage * tokens,
                    )
                )
            pools[role] = samples
        return Observation(
            t,
            pools,
            self.arrived,
            self.prompt_tokens,
            self.finished,
            self.output_tokens,
            self.requested_output_tokens,
        )

    def _resize(self, role: str, target: int) -> None:
        pool = self.prefill if role == "prefill" else self.decode
        members = self._members(pool)
        if target > len(members):
            used = sum(1 for e in self.engines if e.index not in self.leaving)
            for _ in range(min(target - len(members), self.slots - used)):
                e = _Engine(self, len(self.engines), self.config)
                self.engines.append(e)
                pool.append(e)
                self.joins_at[e.index] = self.now_s + self.cold_start_s
        else:
            for e in sorted(members, key=lambda x: -x.index)[: len(members) - target]:
                self.leaving.add(e.index)

    def _count_ended(self, records: list[_Record]) -> None:
        if self._open is None:
            self._open = set(range(len(records)))
        for i in [i for i in self._open if len(records[i].token_times) >= records[i].output_len]:
            self._open.discard(i)
            self.finished += 1
            self.output_tokens += len(records[i].token_times)

    # ---- pool moves ----------------------------------------------------------------

    def _pool(self, role: str) -> list[_Engine]:
        return self.prefill if role == "prefill" else self.decode

    def _move(self, source: str, dest: str, t: float) -> None:
        """One engine of ``source`` (the least busy, newest first) to ``dest``."""
        members = self._members(self._pool(source))
        if len(members) <= 1:
            return
        old = min(members, key=lambda e: (e.num_unfinished(), -e.index))
        self.leaving.add(old.index)
        new = _Engine(self, len(self.engines), self.config)
        self.engines.append(new)
        self._pool(dest).append(new)
        self.joins_at[new.index] = float("inf")  # until the old one has drained
        self.moving[old.index] = (new.index, source)
        self.moves.append((t, source, dest))

    def _progress_moves(self, t: float) -> None:
        for old_i, (new_i, source) in list(self.moving.items()):
            old = self.engines[old_i]
            s = old.sched
            if source == "decode" and old.busy_until is None and not s.waiting_for_remote:
                self._migrate_streams(old)
            if not s.has_unfinished_requests():
                self.gone.add(old_i)
                self.joins_at[new_i] = t + self.switch_s
                del self.moving[old_i]

    def _migrate_streams(self, old: _Engine) -> None:
        """Every stream on ``old`` continues elsewhere (module doc); one still
        waiting for its handoff is admitted to another decode engine as it
        was (its prefill engine still holds its KV)."""
        targets = [e for e in self.accepting(self.decode) if e.index != old.index]
        if not targets:
            return
        prefill = [e for e in self.prefill if e.index not in self.leaving
                   and self.joins_at.get(e.index, 0.0) <= self.now_s]  # fmt: skip
        for rid, r in list(old.sched.requests.items()):
            if r.is_finished:
                continue
            i = int(rid[1:])
            tokens, params = list(r.all_token_ids), r.kv_transfer_params
            left = r.sampling_params.max_tokens - r.num_output_tokens
            if not r.num_output_tokens:  # not started: as it was
                tokens, left = list(r.prompt_token_ids), r.sampling_params.max_tokens
                params = dict(params) if params else None
            old.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            self.migrated += 1
            if (
                r.num_output_tokens
                and left > 1
                and prefill
                and (len(tokens) - 1 >= self.handoff_min_tokens)
            ):  # a fresh prefill handoff: P samples the next token, then D reads
                p = min(prefill, key=lambda x: (x.prompt_tokens_left(), x.index))
                sp = SamplingParams(max_tokens=1, ignore_eos=True)
                self.reprefilled += 1
                pid = f"p{i}.m{self.migrated}"  # p<i> may still be held on its engine
                p.sched.add_request(Request(pid, tokens, sp, arrival_time=self.now_s,
                                            kv_transfer_params={"sim_hold": True}))  # fmt: skip
                continue
            if r.num_output_tokens:
                params = None  # recomputed by the decode engine
            e = min(targets, key=lambda x: (x.num_unfinished(), x.index))
            sp = SamplingParams(max_tokens=left, ignore_eos=True)
            e.sched.add_request(
                Request(rid, tokens, sp, arrival_time=self.now_s, kv_transfer_params=params)
            )
