"""Config fields that carry their own CLI flag, help text and value checks.

A field is declared once with `option(default, help, ...)`; from it come the command-line flag
(`add_cli_args` / `config_from_cli_args`), the keyword the offline API accepts, and the check
its value gets when the dataclass is built (`check_fields`, called from `__post_init__`). A bad
value raises `ConfigError`, which knows the field, so the CLI can name the flag and the API
the keyword. Imports no torch: the CLI builds and checks every config before loading anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any


def option(
    default: Any,
    help: str,
    *,
    flags: tuple[str, ...] = (),
    choices: tuple | None = None,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    help_default: str | None = None,
    **kw: Any,
) -> Any:
    """A dataclass field with its CLI help text and value checks.

    flags: the CLI spellings (the first long one names the field in errors; the default is
    `--field-name`, with the class prefix); choices / min / max / above (exclusive minimum):
    checked on construction; help_default: what `--help` shows as the default, when the
    literal default is a placeholder resolved later.
    """
    meta = {
        "help": help,
        "flags": flags,
        "choices": choices,
        "min": min,
        "max": max,
        "above": above,
        "help_default": help_default,
        **kw,
    }
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """A config value a user chose is invalid. `str()` names the field; `cli_message()` the
    flag that sets it."""

    def __init__(self, cls: type, name: str, detail: str) -> None:
        super().__init__(f"{name} {detail}")
        self.cls, self.name, self.detail = cls, name, detail

    def cli_message(self) -> str:
        return f"{flag_name(self.cls, self.name)} {self.detail}"


def unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _prefix(cls: type) -> str:
    return getattr(cls, "CLI_PREFIX", "")


def _flags(cls: type, f: dataclasses.Field) -> tuple[str, ...]:
    given = f.metadata.get("flags") or ()
    if given:
        return tuple(given)
    name = f"{_prefix(cls)}_{f.name}" if _prefix(cls) else f.name
    return ("--" + name.replace("_", "-"),)


def _dest(cls: type, f: dataclasses.Field) -> str:
    return f"{_prefix(cls)}_{f.name}" if _prefix(cls) else f.name


def flag_name(cls: type, name: str) -> str:
    """The flag that sets field `name` of `cls` (its first long spelling)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return next(s for s in _flags(cls, f) if s.startswith("--"))
    return "--" + name.replace("_", "-")


def keyword_aliases(cls: type) -> dict[str, str]:
    """Keyword -> field name for every long flag spelling of `cls`'s own leaf fields
    (`--tensor-parallel-size` -> tensor_parallel_size -> tp_size)."""
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.name
        for spelling in _flags(cls, f):
            if spelling.startswith("--") and not _prefix(cls):
                out[spelling[2:].replace("-", "_")] = f.name
    return out


def check_fields(obj: Any) -> None:
    """Type, choice and range checks from each field's metadata; ConfigError on the first bad
    value. Nested dataclasses check themselves."""
    cls = type(obj)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value, meta, tp = getattr(obj, f.name), f.metadata, unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) or not meta:
            continue
        if value is None and tp is not hints[f.name]:
            continue  # an optional field left unset ("auto")

        def bad(detail: str, name: str = f.name) -> ConfigError:
            return ConfigError(cls, name, detail)

        if tp is bool and not isinstance(value, bool):
            raise bad(f"must be true or false, got {value!r}")
        if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise bad(f"must be an integer, got {value!r}")
        if tp is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise bad(f"must be finite, got {value!r}")
        if tp is str and not isinstance(value, str):
            raise bad(f"must be a string, got {value!r}")
        if meta.get("choices") and value not in meta["choices"]:
            raise bad(f"must be one of {', '.join(map(str, meta['choices']))}; got {value!r}")
        lo, hi, above = meta.get("min"), meta.get("max"), meta.get("above")
        if lo is not None and value < lo:
            raise bad(f"must be >= {lo}, got {value!r}")
        if above is not None and value <= above:
            raise bad(f"must be > {above}, got {value!r}")
        if hi is not None and value > hi:
            raise bad(f"must be <= {hi}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# CLI flags generated from the fields


def add_cli_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, skip: tuple[str, ...] = ()
) -> None:
    """One flag per leaf field of `cls`; nested configs add theirs (flattened, with their
    class's CLI_PREFIX, e.g. `--spec-num-steps`)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            add_cli_args(parser, tp, skip)
            continue
        if not f.metadata:
            continue  # not a user option (set by the command itself)
        meta = f.metadata
        shown = meta.get("help_default") or repr(f.default)
        kw: dict[str, Any] = dict(
            dest=_dest(cls, f), default=None, help=f"{meta.get('help', '')} (default: {shown})"
        )
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(
                type=tp,
                choices=meta.get("cli_choices") or meta.get("choices"),
                metavar=meta.get("metavar"),
            )
        parser.add_argument(*_flags(cls, f), **kw)


def config_from_cli_args(
    args: argparse.Namespace, cls: type, base: Any = None, **overrides: Any
) -> Any:
    """Inverse of `add_cli_args`: flags left unset keep the dataclass (or `base`) default.
    `overrides` replace top-level fields (nested ones take dicts of changes)."""
    values = cli_values(args, cls)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            values[key] = {**values[key], **value}
        else:
            values[key] = value
    return build(cls, values, base)


def cli_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` (nested: dicts) whose flags were given on the command line."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            values[f.name] = cli_values(args, tp)
            continue
        value = getattr(args, _dest(cls, f), None)
        if value is not None:
            values[f.name] = value
    return values


def build(cls: type, values: dict[str, Any], base: Any = None) -> Any:
    """`cls(**values)` with nested dicts built into their dataclasses (over `base`'s)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, tp = values[f.name], unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = build(tp, value, getattr(base, f.name) if base is not None else None)
        out[f.name] = value
    return dataclasses.replace(base, **out) if base is not None else cls(**out)
