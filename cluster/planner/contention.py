"""Engines that share one host's cores: processor sharing on the simulator's
virtual clock.

The profile times one engine alone, with its threads on cores nobody else
wants. On a CPU box several engine processes (and the gateway, and whatever
else runs there) share the same cores, and when more threads are runnable
than there are cores each gets a fair share of them: a step that takes 10 ms
alone takes 20 ms while two single-threaded engines compute on one core. A
GPU deployment gives each engine a device of its own and has no such term
(a profile without a ``host`` section).

``HostShare`` is the profile's ``host`` section::

    "host": {"cores": 2,              # cores the engines share (nproc)
             "engine_threads": 1,     # cores a computing engine keeps busy (torch threads)
             "cpu_per_token_s": 0.0,  # the serving path's CPU per streamed token
             "background_cores": 0.0} # other processes' demand, on average

``CpuShare`` does the arithmetic. Each job (an engine's step; the serving
path's backlog of per-token work) has a remaining *solo* time: what it
still takes with its threads on free cores. While the runnable threads
(``demand``: the threads of every job with work left, plus the background)
outnumber the cores, every job advances at ``cores / demand`` solo seconds
per second; otherwise at 1. Rates change only when a job starts or ends, so
between two such events the arithmetic is exact: ``advance(t)`` charges the
time since the last event, ``finish_s(key)`` is when a job ends if nothing
else starts or ends first, and the simulator asks again after every event.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import asdict, dataclass
from typing import Any

EPS_S = 1e-12  # remaining work below this is done (float noise of the rate products)


@dataclass
class HostShare:
    cores: float
    engine_threads: float = 1.0
    cpu_per_token_s: float = 0.0
    background_cores: float = 0.0

    def __post_init__(self) -> None:
        for name, low, strict in (
            ("cores", 0, True),
            ("engine_threads", 0, True),
            ("cpu_per_token_s", 0, False),
            ("background_cores", 0, False),
        ):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok or (v <= low if strict else v < low):
                raise ValueError(
                    f"profile: host.{name} must be a number {'>' if strict else '>='} 0"
                )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> HostShare:
        if not isinstance(obj, dict):
            raise ValueError("profile: host must be an object")
        unknown = set(obj) - {"cores", "engine_threads", "cpu_per_token_s", "background_cores"}
        if unknown:
            raise ValueError(f"profile: host.{sorted(unknown)[0]} is not a host field")
        if "cores" not in obj:
            raise ValueError("profile: host.cores is required")
        return cls(**obj)


class CpuShare:
    """Processor sharing of ``cores`` among jobs and an always-runnable
    ``background`` (cores' worth of other threads)."""

    def __init__(self, cores: float, background: float = 0.0) -> None:
        if cores <= 0:
            raise ValueError("cores must be > 0")
        if background < 0:
            raise ValueError("background must be >= 0")
        self.cores, self.background = cores, background
        self.now_s = 0.0
        self._jobs: dict[Hashable, list[float]] = {}  # key -> [remaining solo s, threads]

    def demand(self) -> float:
        """Runnable threads: the jobs with work left and the background."""
        return self.background + sum(threads for _, threads in self._jobs.values())

    def rate(self) -> float:
        """Solo seconds each job advances per second now."""
        d = self.demand()
        return 1.0 if d <= self.cores else self.cores / d

    def advance(self, now_s: float) -> None:
        """Charge every job the progress from the last event to ``now_s``."""
        if now_s < self.now_s:
            raise ValueError(f"time goes forward: {now_s} < {self.now_s}")
        done = (now_s - self.now_s) * self.rate()
        for job in self._jobs.values():
            job[0] = max(0.0, job[0] - done)
        self.now_s = now_s

    def add(self, key: Hashable, work_s: float, threads: float = 1.0) -> None:
        """More work for ``key`` from now (a new job, or a backlog that grows)."""
        if work_s < 0 or threads <= 0:
            raise ValueError("work_s must be >= 0 and threads > 0")
        job = self._jobs.setdefault(key, [0.0, threads])
        job[0] += work_s
        job[1] = threads

    def remaining_s(self, key: Hashable) -> float:
        job = self._jobs.get(key)
        return job[0] if job else 0.0

    def done(self, key: Hashable) -> bool:
        return self.remaining_s(key) <= EPS_S

    def remove(self, key: Hashable) -> None:
        self._jobs.pop(key, None)

    def finish_s(self, key: Hashable) -> float:
        """When ``key`` ends if no job starts or ends before (``now_s`` if it has none left)."""
        return self.now_s + self.remaining_s(key) / self.rate()

    def jobs(self) -> list[Hashable]:
        return list(self._jobs)
