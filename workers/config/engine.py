"""``EngineConfig``: the tree of sections (``sections.py``) and its flat view.

Readers go through the sections (``config.cache.block_size``); users and the
commands name a setting by its flat key (``block_size``, ``kv_lease_s``: the
YAML key, the flag's name, a pool's override). ``engine_fields()`` lists every
leaf with its key; ``EngineConfig.from_flat`` / ``replace`` / ``flat`` map keys
onto the tree. Keys are unique over the tree (checked when the list is built).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.config_fields import OptionMeta, hints, key_of, meta_of, option
from tandem.workers.config.checks import check_engine_config
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

# section attribute -> its --help group and reference heading
ENGINE_SECTIONS = {
    "model": "Engine: model and device",
    "cache": "Engine: KV cache",
    "offload": "Engine: KV offloading tiers (host memory, disk)",
    "scheduler": "Engine: scheduling",
    "parallel": "Engine: tensor parallelism and threads",
    "graphs": "Engine: CUDA graphs, torch.compile, prefill attention",
    "kv_transfer": "Engine: KV transfer and KV events",
    "output": "Engine: output backpressure",
    "runtime": "Engine: set by the command; test hooks",
}


def _section(cls: type, title: str) -> Any:
    return option(default_factory=cls, help=title)


@dataclass
class EngineConfig:
    """One engine's settings, one section per concern (``ENGINE_SECTIONS``)."""

    model: ModelConfig = _section(ModelConfig, ENGINE_SECTIONS["model"])
    cache: CacheConfig = _section(CacheConfig, ENGINE_SECTIONS["cache"])
    offload: OffloadConfig = _section(OffloadConfig, ENGINE_SECTIONS["offload"])
    scheduler: EngineSchedulingConfig = _section(
        EngineSchedulingConfig, ENGINE_SECTIONS["scheduler"]
    )
    parallel: ParallelConfig = _section(ParallelConfig, ENGINE_SECTIONS["parallel"])
    graphs: GraphsConfig = _section(GraphsConfig, ENGINE_SECTIONS["graphs"])
    kv_transfer: KVTransferSection = _section(KVTransferSection, ENGINE_SECTIONS["kv_transfer"])
    output: OutputConfig = _section(OutputConfig, ENGINE_SECTIONS["output"])
    runtime: RuntimeConfig = _section(RuntimeConfig, ENGINE_SECTIONS["runtime"])

    def __post_init__(self) -> None:
        check_engine_config(self)  # ValueError naming the setting (checks.py)

    @classmethod
    def from_flat(cls, **settings: Any) -> EngineConfig:
        """The config with ``settings`` given by flat key over the defaults
        (``EngineConfig.from_flat(model="tiny", max_num_seqs=8)``); ValueError
        naming an unknown key."""
        by_section = _by_section(settings)
        return cls(**{name: section_type(name)(**by_section.get(name, {})) for name in SECTIONS})

    def replace(self, **settings: Any) -> EngineConfig:
        """A copy with ``settings`` changed, by flat key (or a whole section by its
        attribute); every section is a fresh copy. ValueError naming an unknown key."""
        whole = {  # a section given whole; the key "model" is also a setting (the model's name)
            k: settings.pop(k)
            for k in list(settings)
            if k in SECTIONS and isinstance(settings[k], section_type(k))
        }
        by_section = _by_section(settings)
        return EngineConfig(
            **{
                name: whole.get(name)
                or dataclasses.replace(getattr(self, name), **by_section.get(name, {}))
                for name in SECTIONS
            }
        )

    def flat(self, internal: bool = True) -> dict[str, Any]:
        """``{flat key: value}`` of every setting (``internal``: also those the
        command sets itself)."""
        return {
            leaf.key: getattr(getattr(self, leaf.section), leaf.name)
            for leaf in engine_fields(internal=internal)
        }

    def get(self, key: str) -> Any:
        """One setting by its flat key."""
        leaf = engine_leaf(key)
        return getattr(getattr(self, leaf.section), leaf.name)

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_dict(self.scheduler.speculative_config)

    def uses_async_scheduling(self) -> bool:
        """Whether the overlapped loop runs (before the tensor-parallel exception). Auto turns
        it on for CUDA: on an H200 (2026-11-26, ``benchmarks/gpu_engine.py``, the 1B-shaped
        bf16 Llama) it cut the decode step at batch 1/64/256 from 1.60/2.55/6.04 ms to
        1.25/1.82/4.49 ms. On CPU the step thread's gain is smaller than its noise
        (``benchmarks/async_scheduling.py``), so auto stays synchronous there."""
        if self.scheduler.async_scheduling is None:
            return self.model.device.startswith("cuda")
        return self.scheduler.async_scheduling


SECTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def section_type(name: str) -> type:
    return hints(EngineConfig)[name]


@dataclass(frozen=True)
class Leaf:
    """One engine setting: where it lives in the tree and its flat key."""

    section: str  # EngineConfig attribute
    name: str  # attribute in the section
    key: str  # flat key: YAML key, argparse dest, pool override, from_flat keyword
    owner: type  # the section's class
    field: dataclasses.Field
    meta: OptionMeta
    hint: Any

    @property
    def default(self) -> Any:
        """The field's plain default (None for a factory)."""
        return self.field.default if self.field.default is not dataclasses.MISSING else None


@functools.cache
def _all_leaves() -> tuple[Leaf, ...]:
    out = []
    for section in SECTIONS:
        cls = section_type(section)
        for f in dataclasses.fields(cls):
            meta = meta_of(cls, f)
            if meta is None:
                raise TypeError(f"{cls.__name__}.{f.name} has no option() metadata")
            out.append(Leaf(section, f.name, key_of(cls, f), cls, f, meta, hints(cls)[f.name]))
    keys = [leaf.key for leaf in out]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise TypeError(f"EngineConfig keys named twice: {sorted(dup)}")
    return tuple(out)


@functools.cache
def _leaves_by_key() -> dict[str, Leaf]:
    return {leaf.key: leaf for leaf in _all_leaves()}


def engine_fields(internal: bool = False) -> list[Leaf]:
    """Every engine setting in tree order (``internal``: also those the command
    sets itself)."""
    return [leaf for leaf in _all_leaves() if internal or not leaf.meta.internal]


def engine_leaf(key: str) -> Leaf:
    """The setting of flat key ``key``; ValueError naming an unknown one."""
    leaf = _leaves_by_key().get(key)
    if leaf is None:
        raise ValueError(f"EngineConfig has no setting {key!r}")
    return leaf


def find_leaf(key: str) -> Leaf | None:
    return _leaves_by_key().get(key)


def _by_section(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        leaf = engine_leaf(key)
        out.setdefault(leaf.section, {})[leaf.name] = value
    return out
