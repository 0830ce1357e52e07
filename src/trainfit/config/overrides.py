"""The command-line syntax of config overrides: `--section.field=value` or `--section.field value`.

Kept apart from argparse: the fields are many and documented in the schema, so the CLI takes them
out of argv here and argparse sees only its own options. Values are text until the field's type hint
turns them into Python values (the checks against the type itself are trainfit/configure/load.py's).

Ours rather than tyro or jsonargparse: this file is ~80 lines, keeps the `field=value: fix` errors
and the TOML path, and costs nothing at import; either library would add import time and new
dependencies to a `trainfit estimate` process (benchmarks/README.md has the timings).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from trainfit.config.schema import ConfigError, field_error


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and "." in arg[2:].split("=", 1)[0]


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, the overrides as `--section.field=value`), order kept in each.

    A spaced value is the next argument, which may start with one dash (`--parallel.dp_shard -1`)
    but not with two: that is an option, so the override has no value and is rejected, never
    guessed (a value that really starts with `--` is written `--data.path=--odd`)."""
    others: list[str] = []
    overrides: list[str] = []
    args = iter(argv)
    for arg in args:
        if not _is_override(arg):
            others.append(arg)
        elif "=" in arg:
            overrides.append(arg)
        else:
            value = next(args, None)
            if value is None:
                raise ConfigError(f"override {arg!r} has no value: write {arg}=VALUE or {arg} VALUE")
            if value.startswith("--"):
                raise ConfigError(f"override {arg!r} has no value: the next argument, {value!r}, starts with '--' "
                                  f"and is read as an option; write {arg}=VALUE (the only way to give a value that "
                                  "starts with '--')")
            overrides.append(f"{arg}={value}")
    return others, overrides


def parse_override_value(key: str, text: str, hint: Any) -> Any:
    """Command-line text as the Python value a field of type `hint` takes (then checked like TOML)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if typing.get_origin(base) is Literal:
        literal_types = {type(a) for a in typing.get_args(base)}
        return int(text) if literal_types == {int} and text.lstrip("-").isdigit() else text
    if typing.get_origin(base) is tuple:
        element = typing.get_args(base)[0]
        return [_parse_scalar(key, part, element) for part in text.split(",") if part.strip()]
    return _parse_scalar(key, text, base)


def _parse_scalar(key: str, text: str, kind: Any) -> Any:
    if text.lower() in ("none", "null") and kind is not str:
        return None
    try:
        if kind is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        wanted = {int: "an integer", float: "a number"}.get(kind, "true or false")
        raise field_error(key, text, f"must be {wanted}") from None
    return text
