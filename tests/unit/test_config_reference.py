"""docs/configuration.md's reference is generated from the configuration
tree (cluster/cli/config/reference.py): the committed page must equal a fresh
rendering, so a field's help, default or flag cannot change without it."""

import argparse

from tandem.cluster.cli.config.reference import PAGE, reference, render
from tandem.cluster.cli.main import build_parser


def test_committed_reference_is_fresh():
    page = PAGE.read_text()
    assert render(page) == page, "stale: run python -m tandem.cluster.cli.config.reference"


def test_reference_names_every_flag_of_serve_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = reference()
    shown = [
        o
        for a in sub.choices["serve"]._actions
        if a.help != argparse.SUPPRESS and a.dest not in ("help", "config", "check_config")
        for o in a.option_strings
    ]
    for flag in shown:
        if f"`{flag}`" in text:
            continue
        role, _, name = flag[2:].partition("-")  # a pool's variant of an engine flag
        assert role in ("prefill", "decode", "colocated") and f"`--{name}`" in text, flag
