"""KV cache tiers below the device cache: host memory and disk.

``config.py`` (flags, fingerprint), ``host.py`` and ``disk.py`` (one tier each,
own LRU and checksums; the disk tier's segment files in ``segments.py``, a load's
reads of them in ``disk_loads.py``), ``store.py`` (the index over both and the copy thread),
``connector.py`` (the scheduler and worker sides the engine plugs in as its KV
connector). docs/architecture.md, "KV cache tiers", is the design.
"""
