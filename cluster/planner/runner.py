"""The planner's loop: observe, decide, resize, every ``--planner-interval-s``.

    every interval:  observe() -> Observation        (the gateway's own figures)
                     planner.decide(obs) -> Decisions (autoscale.py)
                     each one: logged with its reason and inputs, recorded
                     (record(decision): tandem:planner_decisions_total,
                     /cluster/state), and unless it holds, scale(pool, target)
                     (the resize the admin route calls; removals first, so
                     a pool that grows finds the room another one left); a
                     pool move (moves.py) is move(source, destination) when
                     the backend can move an engine, else the two resizes
    in between,      planner.watch(obs) (sla only; watch.py): decisions only
    every watch      when a breach is measured and the re-plan changes a
    interval         pool, then handled as a round's; with a watch the first
                     round (sla's baseline) runs at the start, not an
                     interval later, so the watch works from the start

Nothing here knows the backend: ``cluster/cli/planning.py`` passes the three
callables, and tests pass their own with a fake clock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.cluster.planner.autoscale import HOLD, Decision, Observation
from tandem.cluster.planner.moves import plan

logger = logging.getLogger(__name__)


class PlannerRunner:
    def __init__(
        self,
        planner: Any,  # LoadPlanner | SlaPlanner
        observe: Callable[[], Observation],
        scale: Callable[[str, int], Awaitable[Any]],
        record: Callable[[Decision], None],
        interval_s: float,
        watch_interval_s: float = 0.0,  # 0: no watch between rounds
        move: Callable[[str, str], Awaitable[Any]] | None = None,  # source, destination
    ) -> None:
        self.move = move
        self.planner = planner
        self.observe = observe
        self.scale = scale
        self.record = record
        self.interval_s = interval_s
        self.watch_interval_s = watch_interval_s if hasattr(planner, "watch") else 0.0

    async def step(self) -> list[Decision]:
        """One round: every pool's decision, the resizes done."""
        return await self._apply(self.planner.decide(self.observe()))

    async def watch_step(self) -> list[Decision]:
        """One look between rounds: decisions only on a measured breach."""
        return await self._apply(self.planner.watch(self.observe()))

    async def _apply(self, decisions: list[Decision]) -> list[Decision]:
        for d in decisions:
            figures = " ".join(f"{k}={v:.4g}" for k, v in sorted(d.inputs.items()))
            log = logger.debug if d.action == HOLD else logger.info
            log("planner: %s %s %d -> %d (%s) %s", d.pool, d.action, d.current, d.target,
                d.reason, figures)  # fmt: skip
            self.record(d)
        for kind, pool, arg in plan(decisions, self.move is not None):  # free room first
            try:
                if kind == "move":
                    await self.move(pool, arg)
                else:
                    await self.scale(pool, arg)
            except ValueError as exc:  # refused (bounds changed, a pool not owned here)
                logger.warning("planner: %s of %s (%s) refused: %s", kind, pool, arg, exc)
        return decisions

    async def run(self) -> None:
        """Forever (cancel to stop); a failed round is logged and the next one runs."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval_s  # the next round
        if self.watch_interval_s:  # a watch needs its baseline (sla's first round) now
            due = loop.time()
        while True:
            wait = due - loop.time()
            if self.watch_interval_s:
                wait = min(wait, self.watch_interval_s)
            await asyncio.sleep(max(0.0, wait))
            try:
                # without a watch every wake is a round (a sleep may end a hair early)
                if not self.watch_interval_s or loop.time() >= due:
                    due = loop.time() + self.interval_s
                    await self.step()
                else:
                    await self.watch_step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep planning
                logger.exception("planner round failed")
