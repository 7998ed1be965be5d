"""Config fields that describe themselves: one ``dataclasses.field`` carries a
setting's default, help, flag and YAML key, so the command line, the YAML
loader and the reference page are generated from the config classes
(``cluster/cli/config/``) instead of being written beside them::

    @dataclass(frozen=True)
    class GatewayLimits:
        max_num_requests: int = option(0, help="concurrent requests; more get 503")

    ->  flag --max-num-requests, YAML key max_num_requests, type int, default 0

Rules (``flags_of``):

    key       the YAML key and argparse dest: the field name unless ``key=``
    flag      ``--`` + key with ``-`` for ``_`` unless ``flag=`` names one
    bool      default False: ``--key`` turns it on; default True: ``--no-key``
              turns it off; default None (auto): both
    per_pool  the field means something per engine pool (``--decode-X``)
    internal  set by the program (an engine's id, role, secret): no flag, no key
    yaml_only a key without a flag (test hooks)

Standard library only and at the bottom of the import graph: the config
classes of every layer (engine, gateway, routing) use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

MISSING = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class OptionMeta:
    help: str
    per_pool: bool = False
    key: str | None = None  # YAML key / argparse dest; None = the field name
    flag: str | None = None  # None = derived from the key
    short: str | None = None  # e.g. -tp
    parse: Callable[[str], Any] | None = None  # text (flag, YAML string) -> value
    choices: Sequence[str] | None = None
    metavar: str | None = None
    internal: bool = False
    yaml_only: bool = False
    default_text: str | None = None  # shown instead of a default that says little (None)
    secret: bool = False  # printed as "<set>"


def option(
    default: Any = MISSING,
    *,
    help: str,  # noqa: A002 (argparse's word)
    default_factory: Any = MISSING,
    repr: bool = True,  # noqa: A002
    **meta: Any,
) -> Any:
    """``dataclasses.field`` with an ``OptionMeta`` (module doc)."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        repr=repr,
        metadata={"option": OptionMeta(help=help, **meta)},
    )


# Field docs of classes whose module another change owns (the serve tree
# describes them from outside): (class, field name) -> OptionMeta
_OVERLAY: dict[tuple[type, str], OptionMeta] = {}


def describe(cls: type, **metas: OptionMeta) -> None:
    """Give the fields of ``cls`` their ``OptionMeta`` from outside its module."""
    names = {f.name for f in dataclasses.fields(cls)}
    for name, meta in metas.items():
        if name not in names:
            raise ValueError(f"{cls.__name__} has no field {name!r}")
        _OVERLAY[(cls, name)] = meta


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls``: a config that exposes a
    setting another class consumes takes that class's default instead of a copy."""
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    if f.default is MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no plain default")
    return f.default


def meta_of(cls: type, f: dataclasses.Field) -> OptionMeta | None:
    return _OVERLAY.get((cls, f.name)) or f.metadata.get("option")


def key_of(cls: type, f: dataclasses.Field) -> str:
    meta = meta_of(cls, f)
    return (meta.key if meta and meta.key else None) or f.name


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``X | None``, else ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def type_name(hint: Any) -> str:
    """``int``, ``float | None``, ``list[int]``: how the reference names a type."""
    base, optional = unwrap_optional(hint)
    name = getattr(base, "__name__", None) if typing.get_origin(base) is None else None
    text = name or str(base).replace("typing.", "")
    return f"{text} | None" if optional else text


def coerce(value: Any, hint: Any, name: str, parse: Callable[[str], Any] | None = None) -> Any:
    """``value`` (from YAML or keyword arguments) as a ``hint``; ValueError naming
    ``name`` when it is not one. Text goes through ``parse`` when the field has one."""
    base, optional = unwrap_optional(hint)
    if value is None:
        if optional or base is Any:
            return None
        raise ValueError(f"{name} may not be empty (null)")
    if parse is not None and isinstance(value, str):
        try:
            return parse(value)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{name}: {exc}") from None
    origin = typing.get_origin(base)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "on", "off"):
            return value.lower() in ("true", "on")
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if base is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if base is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return value
    if base is str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return str(value)
    if origin in (list, tuple):
        (item, *rest) = typing.get_args(base) or (Any,)
        if isinstance(value, str | int):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list, got {value!r}")
        items = [coerce(v, item, name) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or base is dict:
        value = json_text(value, name)
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping, got {value!r}")
        return dict(value)
    return value


def json_text(value: Any, name: str) -> Any:
    """``value`` parsed as JSON when it is a string (a flag's text), else as given;
    ``ValueError`` naming ``name`` for bad JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc.msg}): {value!r}") from None


def format_default(value: Any, meta: OptionMeta | None = None) -> str:
    """A default as the help and the reference show it."""
    if meta is not None and meta.default_text:
        return meta.default_text
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return json.dumps(value) if value else "{}"
    return str(value)


def flags_of(key: str, meta: OptionMeta, default: Any, hint: Any, prefix: str = "") -> list:
    """``[(flag, kind)]`` of one field: kind ``value`` takes an argument,
    ``true`` / ``false`` store that boolean (module doc). ``prefix`` ("decode-")
    names a pool's variant."""
    base, _ = unwrap_optional(hint)
    if meta.flag:
        flag = meta.flag
        if base is bool:
            kind = "false" if flag.startswith("--no-") else "true"
            return [("--" + prefix + flag[2:], kind)]
        return [("--" + prefix + flag[2:], "value")]
    name = "--" + prefix + key.replace("_", "-")
    if base is bool:
        if default is None:
            return [(name, "true"), ("--" + prefix + "no-" + key.replace("_", "-"), "false")]
        if default is True:
            return [("--" + prefix + "no-" + key.replace("_", "-"), "false")]
        return [(name, "true")]
    return [(name, "value")]


def _argparse_type(meta: OptionMeta, hint: Any) -> Callable[[str], Any] | None:
    if meta.parse is not None:
        parse = meta.parse

        def typed(text: str) -> Any:
            try:
                return parse(text)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        typed.__name__ = getattr(parse, "__name__", "value")
        return typed
    base, _ = unwrap_optional(hint)
    return base if base in (int, float) else None


def _metavar(base: Any, meta: OptionMeta) -> str | None:
    if meta.choices:
        return None  # argparse shows {a,b}
    if meta.parse is not None:
        return "LIST" if typing.get_origin(base) is list else "VALUE"
    names = {int: "N", float: "F", str: "TEXT"}
    if base in names:
        return names[base]
    if typing.get_origin(base) is dict or base is dict:
        return "JSON"
    return "TEXT"


def add_option(
    container: Any,
    *,
    key: str,
    meta: OptionMeta,
    hint: Any,
    default: Any,
    dest: str,
    prefix: str = "",
    help: str | None = None,  # noqa: A002
    hidden: bool = False,
    short: bool = True,
    show_default: bool = True,
    tag: str = "",
) -> list[str]:
    """Add one field's flags to an argparse parser or group (default None:
    a flag not given leaves the field to YAML or its default). Returns the flags."""
    text = help if help is not None else meta.help
    if show_default:
        text += f" (default: {format_default(default, meta)})"
    text += tag
    base, _ = unwrap_optional(hint)
    names = []
    flags = flags_of(key, meta, default, hint, prefix)
    for i, (flag, kind) in enumerate(flags):
        if i:  # the --no- twin of an auto boolean
            text = f"the opposite of {flags[0][0]}"
        if hidden:
            text = argparse.SUPPRESS
        names.append(flag)
        if kind == "value":
            extra: dict[str, Any] = {}
            if typing.get_origin(base) in (list, tuple) and meta.parse is None:
                extra["nargs"] = "+"
            flag_names = [flag]
            if short and meta.short and not prefix:
                flag_names.append(meta.short)
            container.add_argument(
                *flag_names,
                dest=dest,
                type=_argparse_type(meta, hint),
                choices=meta.choices,
                metavar=meta.metavar or _metavar(base, meta),
                default=None,
                help=text,
                **extra,
            )
        else:
            action = "store_true" if kind == "true" else "store_false"
            container.add_argument(flag, dest=dest, action=action, default=None, help=text)
    return names
