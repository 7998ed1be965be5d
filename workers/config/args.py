"""The engine flags of ``tandem generate`` and ``tandem serve``, generated from
the leaves of ``EngineConfig`` (``engine.py``): one argument group per section,
a flag's argparse dest is its leaf's flat key."""

from __future__ import annotations

import argparse
from typing import Any

from tandem.wire.config_fields import add_option, flags_of
from tandem.workers.config.engine import ENGINE_SECTIONS, engine_fields, engine_leaf

# Pool variants (--decode-device) of settings that are one for every pool: they
# were flags before the pools knew better, so they stay, hidden; tandem serve
# warns and still applies them to that pool.
HIDDEN_POOL_FLAGS = ("dtype", "device", "block_size", "max_model_len", "kv_layout")


def add_engine_arguments(
    parser: argparse.ArgumentParser | Any,
    prefix: str = "",
    exclude: tuple[str, ...] = (),
) -> None:
    """The engine flags, one argument group per section (``exclude``: keys left
    out). ``prefix`` ("decode-") adds a pool's variants into ``parser`` (a parser
    or a group): ``--decode-X`` for the settings that may differ per pool, hidden
    ones for ``HIDDEN_POOL_FLAGS``."""
    groups: dict[str, Any] = {}
    for leaf in engine_fields():
        meta = leaf.meta
        if meta.yaml_only or leaf.key in exclude:
            continue
        if prefix and not (meta.per_pool or leaf.key in HIDDEN_POOL_FLAGS):
            continue
        if prefix:
            container = parser
        else:
            if leaf.section not in groups:
                groups[leaf.section] = (
                    parser.add_argument_group(ENGINE_SECTIONS[leaf.section])
                    if hasattr(parser, "add_argument_group")
                    else parser
                )
            container = groups[leaf.section]
        role = prefix.rstrip("-")
        add_option(
            container,
            key=leaf.key,
            meta=meta,
            hint=leaf.hint,
            default=leaf.default,
            dest=prefix.replace("-", "_") + leaf.key,
            prefix=prefix,
            help=(f"the {role} pool's {main_flags(leaf.key)}" if prefix else None),
            hidden=bool(prefix) and not meta.per_pool,
            show_default=not prefix,
        )


def main_flags(key: str) -> str:
    """The flag(s) of one engine setting: ``--block-size``, ``--async-scheduling /
    --no-async-scheduling``."""
    leaf = engine_leaf(key)
    flags = flags_of(leaf.key, leaf.meta, leaf.default, leaf.hint)
    return " / ".join(flag for flag, _ in flags)


def engine_overrides(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """Settings the user set on the command line, by flat key (None = not given)."""
    p = prefix.replace("-", "_")
    out = {}
    for leaf in engine_fields():
        v = getattr(args, p + leaf.key, None)
        if v is not None:
            out[leaf.key] = v
    return out
