"""A request's path across engines: ``RayBackend`` (``ray_backend.py``), the
production ``Backend``, runs each request as prefill -> KV handoff -> decode
over the ZMQ data plane, moves streams off lost or drained engines
(``migration.py``) and drains engines for operators.

May import ``cluster.engines``, ``cluster.routing``, ``cluster.gateway.backend``
(the interface it implements), scheduler, wire and kvtransfer; never the
gateway's app or ``cluster.cli``.
"""
