"""Flags and YAML onto the serve tree: defaults < YAML < command line.

A YAML file (``--config``) names settings by their flat keys, as the Helm
chart renders them, or by section mappings (what ``--check-config`` prints
under ``config``)::

    prefill: 2                      pools:
    router_busy_threshold: 0.8        prefill: {num_engines: 2}
    max_num_seqs: 64                routing: {busy_threshold: 0.8}
    decode_engine:                  engine: {scheduler: {max_num_seqs: 64}}
      max_num_seqs: 256

The engine mapping also takes flat engine keys (``engine: {max_num_seqs: 64}``,
the form ``--check-config`` printed before the engine had sections).

``<pool>_engine`` (``pools.<pool>.engine``) holds engine keys for one pool. An
unknown key is an error naming it. Settings that are one for every pool (model,
dtype, block size...) given for one pool, as ``--decode-device`` or under
``decode_engine``, still apply to that pool as before, with a warning naming
the setting to use.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

from tandem.cluster.cli.config.keys import (
    Path,
    all_settings,
    build,
    by_key,
    coerce_engine_value,
    pool_engine_path,
    section_names,
)
from tandem.cluster.cli.config.tree import ServeConfig
from tandem.cluster.engines.placement import ROLES
from tandem.wire.config_fields import hints, meta_of
from tandem.workers.config import EngineConfig, engine_fields, find_leaf, main_flags

logger = logging.getLogger("tandem.config")

# engine fields a file could name before the tree although tandem serve sets
# them per engine: accepted, ignored, with a warning
IGNORED_ENGINE_KEYS = {
    "engine_id": "each engine's id is <pool>-<i>",
    "epoch": "an engine's epoch counts its restarts",
}


@dataclasses.dataclass
class Values:
    """Settings given by one source: ``{path: value}`` and each pool's engine keys."""

    values: dict[Path, Any] = dataclasses.field(default_factory=dict)
    pools: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: {r: {} for r in ROLES}
    )

    def update(self, other: Values) -> None:
        self.values.update(other.values)
        for role in ROLES:
            self.pools[role].update(other.pools[role])

    def build(self) -> ServeConfig:
        values = dict(self.values)
        for role in ROLES:
            given = values.pop(pool_engine_path(role), None) or {}
            merged = {**given, **self.pools[role]}
            if merged:
                values[pool_engine_path(role)] = merged
        return build(values)


def _pool_engine_keys(values: Values, role: str, mapping: Any, where: str) -> None:
    mapping = {} if mapping is None else mapping  # `decode_engine:` left empty
    if not isinstance(mapping, dict):
        raise ValueError(f"{where} must be a mapping of engine keys, got {mapping!r}")
    for name, value in mapping.items():
        if name in IGNORED_ENGINE_KEYS:
            logger.warning("%s.%s is ignored: %s", where, name, IGNORED_ENGINE_KEYS[name])
            continue
        leaf = find_leaf(name)
        meta = leaf.meta if leaf else None
        if meta is not None and not meta.internal and not meta.per_pool:
            logger.warning(
                "%s.%s: %s is one setting for every pool; use the top-level key %s "
                "(applied to the %s pool only, as before)",
                where,
                name,
                name,
                name,
                role,
            )
        values.pools[role][name] = coerce_engine_value(name, value, f"{where}.{name}")


def _section(values: Values, cls: type, path: Path, mapping: dict, unknown: list[str]) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in mapping.items():
        f = fields.get(name)
        meta = meta_of(cls, f) if f else None
        dotted = ".".join(path + (name,))
        leaf = find_leaf(name) if cls is EngineConfig and f is None else None
        if leaf is not None and not leaf.meta.internal:  # engine: {max_num_seqs: 64}
            values.values[path + (leaf.section, leaf.name)] = value
            continue
        if f is None or meta is None or meta.internal:
            unknown.append(dotted)
            continue
        hint = hints(cls)[name]
        if cls.__name__ == "PoolConfig" and name == "engine":
            _pool_engine_keys(values, path[-1], value, dotted)
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ValueError(f"--config: {dotted} must be a mapping")
            _section(values, hint, path + (name,), value, unknown)
        else:
            values.values[path + (name,)] = value


def mapping_values(mapping: dict[str, Any], source: str = "--config") -> Values:
    """The settings a YAML mapping (or ``serve_config``'s keywords) gives."""
    values = Values()
    unknown: list[str] = []
    for key, value in mapping.items():
        if key == "cluster_secret":
            raise ValueError(f"{source}: cluster_secret cannot be inline; use cluster_secret_file")
        if key.endswith("_engine") and key.removesuffix("_engine") in ROLES:
            _pool_engine_keys(values, key.removesuffix("_engine"), value, key)
        elif key in section_names() and isinstance(value, dict):
            _section(values, hints(ServeConfig)[key], (key,), value, unknown)
        elif key in by_key():
            values.values[by_key()[key].path] = value
        elif key in section_names():
            raise ValueError(f"{source}: {key} must be a mapping of its settings")
        elif key in IGNORED_ENGINE_KEYS:
            logger.warning("%s: %s is ignored: %s", source, key, IGNORED_ENGINE_KEYS[key])
        else:
            unknown.append(key)
    if unknown:
        internal = sorted(set(unknown) & {leaf.key for leaf in engine_fields(internal=True)})
        why = f" ({', '.join(internal)}: set by tandem serve)" if internal else ""
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}{why}")
    return values


def read_yaml(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping at the top level")
    return data


def pool_dest(role: str, name: str) -> str:
    return f"{role}_{name}"


def args_values(args: argparse.Namespace) -> Values:
    """The settings given on the command line (a flag not given is None)."""
    values = Values()
    for s in all_settings():
        v = getattr(args, s.key, None)
        if v is not None and not s.meta.yaml_only:
            values.values[s.path] = v
    for leaf in engine_fields():
        for role in ROLES:
            v = getattr(args, pool_dest(role, leaf.key), None)
            if v is None:
                continue
            if not leaf.meta.per_pool:
                flag = "--" + role + "-" + main_flags(leaf.key).removeprefix("--")
                logger.warning(
                    "%s: %s is one setting for every pool; use %s "
                    "(applied to the %s pool only, as before)",
                    flag,
                    leaf.key,
                    main_flags(leaf.key),
                    role,
                )
            values.pools[role][leaf.key] = v
    return values


def resolve_config(args: argparse.Namespace) -> ServeConfig:
    """Defaults < YAML file (``--config``) < command line. ValueError names the
    key, flag or field."""
    values = Values()
    if getattr(args, "config", None):
        values.update(mapping_values(read_yaml(args.config)))
    values.update(args_values(args))
    return values.build()


def serve_config(**settings: Any) -> ServeConfig:
    """The tree from flat keys (or section mappings), as a YAML file gives them::

    serve_config(model="tiny", prefill=1, decode=2, max_num_seqs=16, decode_engine={...})
    """
    return mapping_values(settings, source="serve_config").build()
