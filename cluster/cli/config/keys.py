"""The settings of the serve tree as a flat list, and the tree built from
values given by key.

Every leaf of ``ServeConfig`` is one ``Setting``: its path in the tree, its
flat key (the YAML key and the argparse dest, unique), its help group::

    ("routing", "busy_threshold")          router_busy_threshold   Routing
    ("pools", "decode", "num_engines")     decode                  Pools and placement
    ("pools", "decode", "engine")          decode_engine           (a mapping: YAML only)
    ("engine", "scheduler", "max_num_seqs") max_num_seqs           Engine: scheduling

``build(values)`` makes the tree from ``{path: value}``: every section starts
from its default and takes the values given under it, so each default is
written once, on its field.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from tandem.cluster.cli.config.tree import SECTION_TITLES, ServeConfig
from tandem.cluster.engines.placement import ROLES
from tandem.wire.config_fields import OptionMeta, coerce, hints, key_of, meta_of
from tandem.workers.config import ENGINE_SECTIONS, EngineConfig, find_leaf

Path = tuple[str, ...]


@dataclass(frozen=True)
class Setting:
    path: Path
    key: str
    owner: type
    field: dataclasses.Field
    meta: OptionMeta
    hint: Any
    group: str  # --help group and reference section
    role: str | None = None  # the pool of a pool field

    @property
    def per_pool(self) -> bool:
        return self.meta.per_pool

    @property
    def help(self) -> str:
        return self.meta.help.format(role=self.role) if self.role else self.meta.help


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _walk(cls: type, path: Path, group: str, role: str | None) -> list[Setting]:
    out = []
    for f in dataclasses.fields(cls):
        meta = meta_of(cls, f)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no option() metadata")
        if meta.internal:
            continue
        hint = hints(cls)[f.name]
        if _is_section(hint):
            title = SECTION_TITLES.get(f.name, group) if not path else group
            if cls is EngineConfig:
                title = ENGINE_SECTIONS[f.name]
            sub_role = f.name if f.name in ROLES and cls.__name__ == "PoolsConfig" else role
            out += _walk(hint, path + (f.name,), title, sub_role)
            continue
        key = key_of(cls, f)
        if role:
            key = key.format(role=role)
        leaf_group = group
        if not path:
            leaf_group = SECTION_TITLES.get(f.name, group)
        out.append(Setting(path + (f.name,), key, cls, f, meta, hint, leaf_group, role))
    return out


@functools.cache
def all_settings() -> tuple[Setting, ...]:
    """Every leaf, in tree order; keys are unique (checked here)."""
    out = tuple(_walk(ServeConfig, (), "", None))
    seen: dict[str, Path] = {}
    for s in out:
        if s.key in seen:
            raise TypeError(f"key {s.key!r} names both {seen[s.key]} and {s.path}")
        seen[s.key] = s.path
    return out


@functools.cache
def by_key() -> dict[str, Setting]:
    return {s.key: s for s in all_settings()}


@functools.cache
def by_path() -> dict[Path, Setting]:
    return {s.path: s for s in all_settings()}


@functools.cache
def defaults() -> ServeConfig:
    return ServeConfig()


def get(config: Any, path: Path) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def section_names() -> set[str]:
    """Attributes of ``ServeConfig`` that are sections (nested YAML mappings)."""
    return {
        f.name for f in dataclasses.fields(ServeConfig) if _is_section(hints(ServeConfig)[f.name])
    }


def pool_engine_path(role: str) -> Path:
    return ("pools", role, "engine")


def coerce_setting(setting: Setting, value: Any) -> Any:
    return coerce(value, setting.hint, setting.key, setting.meta.parse)


def coerce_engine_value(key: str, value: Any, where: str) -> Any:
    """A value of one engine setting (``where``: ``decode_engine.max_num_seqs``)."""
    leaf = find_leaf(key)
    if leaf is None:
        return value  # PoolConfig names the unknown key
    return coerce(value, leaf.hint, where, leaf.meta.parse)


def build(values: dict[Path, Any]) -> ServeConfig:
    """The tree from ``{path: value}`` over the defaults (module doc). Values are
    coerced to their field's type first; ValueError names the key or field."""
    typed = {}
    for path, value in values.items():
        setting = by_path().get(path)
        typed[path] = coerce_setting(setting, value) if setting else value
    return _build(defaults(), (), typed)


def _build(node: Any, path: Path, values: dict[Path, Any]) -> Any:
    changes = {}
    for f in dataclasses.fields(node):
        p = path + (f.name,)
        if p in values:
            changes[f.name] = values[p]
        elif _is_section(hints(type(node))[f.name]) and any(k[: len(p)] == p for k in values):
            changes[f.name] = _build(getattr(node, f.name), p, values)
    return dataclasses.replace(node, **changes) if changes or not path else node


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _shown(setting: Setting, value: Any) -> Any:
    return "<set>" if setting.meta.secret and value else _plain(value)


def flatten(config: ServeConfig) -> dict[str, Any]:
    """``{key: value}`` of every setting (secrets as ``"<set>"``): a valid YAML file."""
    return {s.key: _shown(s, get(config, s.path)) for s in all_settings()}


def tree(config: Any, path: Path = ()) -> dict[str, Any]:
    """The tree as nested mappings by attribute (internal fields left out,
    secrets as ``"<set>"``): also a valid YAML file."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        meta = meta_of(type(config), f)
        if meta is None or meta.internal:
            continue
        p = path + (f.name,)
        value = getattr(config, f.name)
        if _is_section(hints(type(config))[f.name]):
            out[f.name] = tree(value, p)
        else:
            out[f.name] = _shown(by_path()[p], value)
    return out
