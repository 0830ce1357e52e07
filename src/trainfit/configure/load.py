"""A Config from a TOML file, command-line overrides and nested dicts: names and types checked.

Unknown sections and fields get a suggestion; a value of the wrong type names the field. What the
values mean together (presets, ranges, hardware) is validate.py's.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import tomllib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from trainfit.config.overrides import parse_override_value, split_overrides
from trainfit.config.schema import SECTIONS, Config, ConfigError, field_error
from trainfit.configure.validate import resolve_and_validate


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or the defaults), apply `--section.field=value` / `--section.field value`
    overrides, resolve, validate (with the defaults that follow the model: configure/defaults.py)."""
    return read_config(path, overrides)[1]


def read_config(path: str | Path | None = None, overrides: list[str] | None = None
                ) -> tuple[dict[str, Any], Config, list[str]]:
    """(what the user wrote, the validated Config, the defaults derived from the model and device)."""
    raw = read_raw(path, overrides)
    cfg, derived = config_of_raw(raw)
    return raw, cfg, derived


def config_of_raw(raw: dict[str, Any]) -> tuple[Config, list[str]]:
    """The validated Config of what the user wrote, with the defaults that follow the model and the
    device (configure/defaults.py), and those defaults as notes."""
    from trainfit.configure.defaults import follow_model

    cfg = config_from_dict(raw)
    resolve_and_validate(cfg)
    derived = follow_model(raw, cfg)
    if derived:
        resolve_and_validate(cfg)  # the derived values checked as any
    return cfg, derived


def read_raw(path: str | Path | None = None, overrides: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """What the user wrote: the TOML file's tables with the overrides applied, as nested dicts
    (`trainfit plan` keeps these fields and searches the rest)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist: pass an existing .toml path")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from err
        except RecursionError:
            raise ConfigError(f"{path}: TOML nested too deep to read; a config is flat tables of fields") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a TOML config is a UTF-8 text file") from err
    return apply_overrides(raw, overrides or [])


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`raw` (a config's tables, changed in place) with `--section.field=value` overrides applied,
    each value parsed as the command line parses it."""
    others, pairs = split_overrides(overrides)
    if others:
        raise ConfigError(f"override {others[0]!r}: write it as --section.field=value or --section.field value, "
                          "e.g. --training.steps=30")
    for item in pairs:
        key, text = item[2:].split("=", 1)
        section, name = key.split(".", 1)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            raise field_error(section, table, "must be a table of fields, e.g. [training] steps = 10")
        table[name] = parse_override_value(key, text, _field_hint(section, name, text))
    return raw


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, rejecting unknown keys and wrong types (not yet validated:
    see validate.resolve_and_validate)."""
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise field_error(section, "<section>", f"unknown section; {_suggest(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise field_error(section, values, "must be a table of fields, e.g. [training] steps = 10")
        cls = SECTIONS[section]
        sections[section] = cls(**{name: _coerce(f"{section}.{name}", value, _field_hint(section, name, value))
                                   for name, value in values.items()})
    return Config(**sections)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists), e.g. to store beside a checkpoint; config_from_dict reads it."""
    return dataclasses.asdict(cfg)


def _field_hint(section: str, name: str, value: Any) -> Any:
    """The type hint of `section.name`; unknown names fail with the closest known one."""
    if section not in SECTIONS:
        raise field_error(section, "<section>", f"unknown section; {_suggest(section, SECTIONS)}")
    hints = _hints(section)
    if name not in hints:
        raise field_error(f"{section}.{name}", value, f"unknown field; {_suggest(name, hints)}")
    return hints[name]


@functools.cache
def _hints(section: str) -> dict[str, Any]:
    """A section's type hints (evaluating the schema's string annotations costs ~0.1 ms; asked per field)."""
    return typing.get_type_hints(SECTIONS[section])


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid names: " + ", ".join(sorted(known))


MAX_INT = 2**63 - 1
"""The largest integer a field takes: torch's int64 (a micro-batch or a count beyond it is a typo)."""


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a TOML/CLI value against a field's type hint; ints are accepted for floats."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if origin is Literal:
        if value not in args:
            raise field_error(key, value, "choose one of " + " | ".join(str(a) for a in args))
        return value
    if origin is tuple and args[-1] is Ellipsis:  # any length
        if not isinstance(value, (list, tuple)):
            raise field_error(key, value, "give a list, e.g. [4, 5, 5, 4]")
        return tuple(_coerce(key, v, args[0]) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise field_error(key, value, f"give {len(args)} values, e.g. [0.9, 0.95]")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args, strict=True))
    if hint is bool:
        if not isinstance(value, bool):
            raise field_error(key, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise field_error(key, value, "must be an integer")
        if abs(value) > MAX_INT:
            raise field_error(key, value, "beyond any count trainfit handles: |value| must be below 2**63 (a 64-bit "
                              "integer); did you mean a smaller one?")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise field_error(key, value, "must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise field_error(key, value, "must be a string")
        return value
    raise AssertionError(f"unhandled type {hint} for {key}")
