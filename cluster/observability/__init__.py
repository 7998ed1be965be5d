"""What operators see: Prometheus metrics (``metrics.py``), where each request's
time went (``tracing/``), ``/cluster/state`` and ``/dashboard``
(``dashboard/``), and log formatting (``logging_setup.py``).

May import ``cluster.gateway.backend`` (the snapshots it renders) and
``cluster.routing.metrics``; never the gateway's app, ``cluster.disagg`` or
``cluster.engines``.
"""
