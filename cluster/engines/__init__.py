"""The engines as Ray actors, and what the gateway knows about them.

    actor.py              EngineActor: one engine (scheduler + workers) in a Ray actor
    pools.py              start and stop a pool's actors (PoolSpec, EngineHandle)
    placement.py          per-pool Ray resources and GPUs, tensor-parallel placement groups
    attach.py             adopt engines an earlier gateway left running; stop-engines
    prefill_endpoints.py  the prefill registry pushed to decode engines
    health.py             liveness model: an engine is alive, slow or dead
    death_watch.py        fast DEAD verdicts: a dropped connection confirmed by the pid

May import workers, wire and ``cluster.observability`` (logging); never the
gateway, ``cluster.disagg`` or ``cluster.routing``.
"""
