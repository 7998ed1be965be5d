"""The configuration reference, generated from the serve tree: one Markdown
table per section (flags, YAML key, tree path, type, default, per pool, help),
written into docs/configuration.md between two markers; the rest of the page
is hand-written and kept.

    python -m tandem.cluster.cli.config.reference            # rewrite the page
    python -m tandem.cluster.cli.config.reference --check    # exit 1 if it is stale

tests/unit/test_config_reference.py fails when the committed page is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.cluster.cli.config.keys import Setting, all_settings, defaults, get
from tandem.wire.config_fields import flags_of, format_default, type_name
from tandem.workers.config import HIDDEN_POOL_FLAGS, main_flags

BEGIN = "<!-- BEGIN generated reference: python -m tandem.cluster.cli.config.reference -->"
END = "<!-- END generated reference -->"
PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(s: Setting) -> str:
    if s.meta.yaml_only:
        return "(YAML only)"
    default = get(defaults(), s.path)
    names = [flag for flag, _ in flags_of(s.key, s.meta, default, s.hint)]
    if s.meta.short:
        names.append(s.meta.short)
    return ", ".join(f"`{n}`" for n in names)


def _type(s: Setting) -> str:
    if s.meta.choices:
        return " \\| ".join(f"`{c}`" for c in s.meta.choices)
    return f"`{type_name(s.hint)}`"


def _row(s: Setting) -> str:
    default = format_default(get(defaults(), s.path), s.meta)
    cells = [
        _flags(s),
        f"`{s.key}`",
        f"`{'.'.join(s.path)}`",
        _type(s),
        f"`{default}`" if s.meta.default_text is None else default,
        "yes" if s.per_pool else "",
        s.help,
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def reference() -> str:
    """The generated part of docs/configuration.md."""
    out = [
        BEGIN,
        "",
        "Generated from the fields of `ServeConfig` (`cluster/cli/config/tree.py`) and",
        "the sections of `EngineConfig` (`workers/config/sections.py`; the scheduling",
        "knobs in `scheduler/config.py`); edit their help there, then run",
        "`python -m tandem.cluster.cli.config.reference`. Columns: the flag(s); the flat YAML",
        "key; the same setting's place in the tree (a YAML section mapping, and what",
        "`--check-config` prints under `config`); its type; its default; whether a pool",
        "may set its own (`--prefill-X`, `--decode-X`, `--colocated-X`, or the key under",
        "`prefill_engine:` ...); what it does.",
        "",
    ]
    groups: dict[str, list[Setting]] = {}
    for s in all_settings():
        groups.setdefault(s.group, []).append(s)
    for title, settings in groups.items():
        out += [
            f"### {title}",
            "",
            "| flag | YAML key | tree | type | default | per pool | what it does |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        out += [_row(s) for s in settings]
        out.append("")
    hidden = ", ".join(f"`{main_flags(name)}`" for name in HIDDEN_POOL_FLAGS)
    out += [
        "### Accepted for compatibility",
        "",
        f"`--prefill-`, `--decode-` and `--colocated-` variants of {hidden} (and the same",
        "keys under `prefill_engine:` ...) are still accepted and applied to that pool,",
        "with a warning naming the setting to use: they are one setting for every pool",
        "(prefill and decode engines exchanging KV must agree on them). They are left",
        "out of `--help`. YAML keys `engine_id` and `epoch` are ignored with a warning",
        "(`tandem serve` names and numbers each engine).",
        "",
        END,
    ]
    return "\n".join(out)


def render(page: str) -> str:
    """``page`` with its generated part replaced (ValueError without the markers)."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE.name}: markers {BEGIN!r} ... {END!r} not found")
    return page[:start] + reference() + page[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = p.parse_args(argv)
    page = args.page.read_text()
    new = render(page)
    if args.check:
        if new != page:
            print(f"{args.page} is stale: run python -m tandem.cluster.cli.config.reference")
            return 1
        return 0
    if new != page:
        args.page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
