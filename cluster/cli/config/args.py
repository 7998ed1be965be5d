"""``tandem serve``'s flags, generated from the serve tree: one argument group
per section, a flag per setting (``wire/config_fields.py`` says how a field
becomes a flag), then the per-pool engine flags (``--decode-max-num-seqs``)
for the engine settings that may differ per pool. Every flag defaults to None
(not given): ``load.resolve_config`` lays the given ones over the YAML file
and the defaults.
"""

from __future__ import annotations

import argparse

from tandem.cluster.cli.config.keys import all_settings, defaults, get
from tandem.cluster.cli.config.load import pool_dest
from tandem.cluster.engines.placement import ROLES
from tandem.wire.config_fields import add_option
from tandem.workers.config import HIDDEN_POOL_FLAGS, engine_fields, main_flags

POOL_GROUP = "Per-pool engine settings"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    files = p.add_argument_group("Configuration file")
    files.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="YAML file of the same settings: flat keys (the flags' names with _) or "
        "section mappings; the command line wins",
    )
    files.add_argument(
        "--check-config",
        action="store_true",
        help="validate flags + YAML, print the resolved config and exit (0 ok, 2 bad)",
    )
    config = defaults()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in all_settings():
        if s.meta.yaml_only:
            continue
        if s.path[0] != "engine" and any(k.startswith("Engine:") for k in groups):
            if POOL_GROUP not in groups:  # right after the engine sections
                groups[POOL_GROUP] = _add_pool_arguments(p)
        if s.group not in groups:
            groups[s.group] = p.add_argument_group(s.group)
        add_option(
            groups[s.group],
            key=s.key,
            meta=s.meta,
            hint=s.hint,
            default=get(config, s.path),
            dest=s.key,
            help=s.help,
            tag=" [per pool]" if s.per_pool else "",
        )


def _add_pool_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = p.add_argument_group(
        POOL_GROUP,
        "the engine settings marked [per pool], for one pool: over --X and the YAML's "
        "top-level keys (YAML: under prefill_engine, decode_engine, colocated_engine)",
    )
    for leaf in engine_fields():
        meta = leaf.meta
        if meta.yaml_only or not (meta.per_pool or leaf.key in HIDDEN_POOL_FLAGS):
            continue
        for role in ROLES:
            add_option(
                group,
                key=leaf.key,
                meta=meta,
                hint=leaf.hint,
                default=leaf.default,
                dest=pool_dest(role, leaf.key),
                prefix=f"{role}-",
                help=f"the {role} pool's {main_flags(leaf.key)}",
                hidden=not meta.per_pool,
                show_default=False,
            )
    return group
