"""Capacity planning without a cluster: a per-engine performance profile
(profile.py, measured by ``tandem profile``), a discrete-event simulator that
replays a trace through the real ``scheduler.Scheduler`` (simulator.py), the
xPyD search (search.py) and the SLA planner's engine-count arithmetic
(sla.py). Nothing here starts Ray or an engine, except ``measure.py``, which
times one in-process engine."""
