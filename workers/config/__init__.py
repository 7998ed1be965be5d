"""Engine configuration: every setting of one engine, as a tree of sections.

This package owns ``EngineConfig`` (``engine.py``): one dataclass per concern
(``sections.py``: model, cache, offload, scheduler, parallel, graphs,
kv_transfer, output, runtime), each leaf carrying its default, help, flag and
whether a pool may set its own (``wire/config_fields.py``); the flat view of
the tree by key (``from_flat``, ``replace``, ``flat``, ``engine_fields``); the
engine flags generated from the leaves (``args.py``); and the checks run when a
config is built (``checks.py``: a ``ValueError`` naming the setting).

The scheduling section extends ``tandem.scheduler.config.SchedulingConfig``, and
the KV transfer section carries ``tandem.kvtransfer.config.KVTransferConfig``'s
field names, so the lower layers' configs take their section whole. It imports
``scheduler``, ``kvtransfer`` (configs only), ``wire`` and ``workers.graphs.sizes``:
nothing here imports torch, so the gateway can build the serve tree.
"""

from tandem.workers.config.args import (
    HIDDEN_POOL_FLAGS,
    add_engine_arguments,
    engine_overrides,
    main_flags,
)
from tandem.workers.config.engine import (
    ENGINE_SECTIONS,
    SECTIONS,
    EngineConfig,
    Leaf,
    engine_fields,
    engine_leaf,
    find_leaf,
    section_type,
)
from tandem.workers.config.sections import (
    CacheConfig,
    EngineSchedulingConfig,
    GraphsConfig,
    KVTransferSection,
    ModelConfig,
    OffloadConfig,
    OutputConfig,
    ParallelConfig,
    RuntimeConfig,
)

__all__ = [
    "ENGINE_SECTIONS",
    "HIDDEN_POOL_FLAGS",
    "SECTIONS",
    "CacheConfig",
    "EngineConfig",
    "EngineSchedulingConfig",
    "GraphsConfig",
    "KVTransferSection",
    "Leaf",
    "ModelConfig",
    "OffloadConfig",
    "OutputConfig",
    "ParallelConfig",
    "RuntimeConfig",
    "add_engine_arguments",
    "engine_fields",
    "engine_leaf",
    "engine_overrides",
    "find_leaf",
    "main_flags",
    "section_type",
]
