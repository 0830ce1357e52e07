"""What the web page asks, answered by the functions the commands call: a request is the config as
the command line would give it (a TOML text and `section.field` values written as on the command
line), so a field's value is parsed, checked and explained exactly as `--section.field=value` is,
and an answer is `trainfit estimate --json`'s or `trainfit plan --json`'s. HTTP-free and torch-free."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainfit.config import Config, ConfigError, iter_fields
from trainfit.config.docs import field_kind
from trainfit.config.schema import SECTIONS
from trainfit.serve.files import FilePolicy, RequestError

MAX_TEXT = 1 << 20
"""Bytes of a TOML or config.json text the page may send (a config is a few KiB)."""
MAX_VALUE = 4096
"""Characters of one field's value."""
FIELD = re.compile(r"^([a-z_]+\.[a-z_0-9]+)=")
"""A ConfigError names its field first (config.field_error's format): `section.field=value: fix`."""


def schema() -> dict[str, Any]:
    """Every config field by section, with its default, its documentation (`--help`'s text), its kind
    (bool, int, float, str, list, or choice with its choices), plus the model presets and the devices
    of the catalog: what the page builds its form from."""
    from trainfit.hardware import GPUS
    from trainfit.models.presets import PRESETS

    hints = {section: typing.get_type_hints(cls) for section, cls in SECTIONS.items()}
    sections: dict[str, list[dict[str, Any]]] = {}
    for section, name, default, doc in iter_fields():
        kind, choices = field_kind(hints[section][name])
        shown = list(default) if isinstance(default, tuple) else default
        sections.setdefault(section, []).append(
            {"name": name, "default": shown, "doc": doc, "kind": kind, "choices": choices})
    return {"sections": sections, "presets": sorted(PRESETS), "gpus": ["cpu", *GPUS]}


def overrides_of(values: Any) -> list[str]:
    """`--section.field=value` arguments of the page's {"section.field": "value as typed"} (the
    command line's syntax: lists comma-separated, booleans true/false)."""
    if not isinstance(values, dict):
        raise RequestError("'values' must be an object of \"section.field\": \"value\" pairs, not "
                           f"{type(values).__name__}")
    out = []
    for key, value in values.items():
        if not isinstance(key, str) or not re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", key):
            raise RequestError(f"field {str(key)[:80]!r}: a field is named section.field, e.g. training.seq_len")
        if not isinstance(value, str | int | float | bool) or isinstance(value, str) and len(value) > MAX_VALUE:
            raise RequestError(f"{key}: a value is a string of at most {MAX_VALUE} characters, as on the command line")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out.append(f"--{key}={text}")
    return out


def raw_config(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What the user wrote: the request's TOML text (optional) with its field values applied, as
    `trainfit estimate CONFIG --section.field=value ...` reads them (ConfigError names a bad one)."""
    from trainfit.configure.load import apply_overrides

    text = request.get("toml", "")
    if not isinstance(text, str) or len(text.encode()) > MAX_TEXT:
        raise RequestError(f"'toml' must be TOML text of at most {MAX_TEXT // 1024} KiB")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"the config's TOML: not valid TOML ({err})") from None
    except RecursionError:
        raise ConfigError("the config's TOML: nested too deep to read; a config is flat tables of fields") from None
    return apply_overrides(raw, overrides_of(request.get("values", {})))


def config_of(request: dict[str, Any], files: FilePolicy) -> tuple[dict[str, dict[str, Any]], Config, list[str]]:
    """(raw, validated Config, the defaults derived for its model) of a request; a path to a file the
    server may not read (serve/files.py) is a RequestError."""
    from trainfit.configure import config_of_raw

    raw = raw_config(request)
    files.check(raw)
    cfg, derived = config_of_raw(raw)
    return raw, cfg, derived


def error_answer(err: ConfigError) -> dict[str, Any]:
    """A named error as the page shows it: beside its field when the message names one."""
    message = str(err)
    match = FIELD.match(message)
    return {"error": message, "field": match.group(1) if match else None}


def estimate(request: dict[str, Any], files: FilePolicy) -> dict[str, Any]:
    """`trainfit estimate --json` of the request's config, or its named error; with "fixes": false
    without the changes that fit (the page asks for those second: the estimate alone takes
    milliseconds, the fixes' search up to ~0.1 s)."""
    from trainfit.plan.answer import estimate_answer

    try:
        _, cfg, derived = config_of(request, files)
        return estimate_answer(cfg, fixes=request.get("fixes", True) is not False, derived=derived)
    except ConfigError as err:
        return error_answer(err)


def toml(request: dict[str, Any], files: FilePolicy) -> str:
    """The request's config as TOML: what the user set (a valid config: ConfigError otherwise)."""
    from trainfit.config.dump import dump_toml

    raw, _, _ = config_of(request, files)
    return dump_toml(raw, "# trainfit config: trainfit estimate THIS_FILE, trainfit train THIS_FILE")


def hf_config(text: Any) -> dict[str, Any]:
    """The model fields of a Hugging Face config.json's text, as `section.field` values the page sets
    (model.preset='' and every dimension: the config stays self-contained), or its named error."""
    import json

    from trainfit.models.hf import model_fields_of_hf

    if not isinstance(text, str) or len(text.encode()) > MAX_TEXT:
        raise RequestError(f"'config_json' must be the text of a config.json, at most {MAX_TEXT // 1024} KiB")
    try:
        parsed = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        where = f" ({err.msg}, line {err.lineno})" if isinstance(err, json.JSONDecodeError) else " (nested too deep)"
        return {"error": f"config.json: not valid JSON{where}", "field": "model.preset"}
    if not isinstance(parsed, dict):
        return {"error": "config.json: must be a JSON object, as Hugging Face writes it", "field": "model.preset"}
    try:
        fields = model_fields_of_hf(parsed)
    except ConfigError as err:
        return {"error": str(err), "field": "model.preset"}
    values = {"model.preset": ""}
    values.update({f"model.{k}": _as_text(v) for k, v in fields.items() if v is not None})
    return {"values": values}


MAX_UPLOADS = 64
"""Uploaded profiles the server keeps (the oldest go first): a client cannot fill its disk."""


def hardware_profile(text: Any, folder: Path) -> dict[str, Any]:
    """A hardware profile's TOML text (what `trainfit calibrate --out FILE` wrote), checked as
    hardware.profile checks it and kept in the server's `folder` under its digest: the
    `hardware.profile` value the page sets, or its named error."""
    import hashlib
    import os
    import tempfile

    from trainfit.hardware_profile import load_profile

    if not isinstance(text, str) or len(text.encode()) > MAX_TEXT:
        raise RequestError(f"'profile_toml' must be the text of a hardware profile, at most {MAX_TEXT // 1024} KiB")
    path = folder / f"profile-{hashlib.sha256(text.encode()).hexdigest()[:16]}.toml"
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, suffix=".toml", delete=False) as f:
        f.write(text)  # checked under a name of its own: two uploads at once never see each other's half
    try:
        load_profile(f.name)
    except ConfigError as err:
        Path(f.name).unlink(missing_ok=True)
        return {"error": str(err).replace(f.name, "the profile"), "field": "hardware.profile"}
    os.replace(f.name, path)
    _keep_newest(folder, MAX_UPLOADS)
    return {"values": {"hardware.profile": str(path)}}


def _keep_newest(folder: Path, count: int) -> None:
    """Remove all but the `count` newest uploaded profiles of `folder`."""
    def age(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile by another upload
            return 0.0

    for old in sorted(folder.glob("profile-*.toml"), key=age)[:-count]:
        old.unlink(missing_ok=True)


def _as_text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value).lower() \
        if isinstance(value, bool) else str(value)


def plan(request: dict[str, Any], files: FilePolicy, progress: Callable[[str], None] | None = None,
         cancelled: Callable[[], bool] | None = None) -> dict[str, Any]:
    """`trainfit plan --json` of the request's config: the fastest layouts that fit (the frontier), or
    with `tokens` the devices and counts by time to train and cost (`gpu_options`, `max_gpus`,
    `prices` as the options of those names)."""
    from trainfit.plan.answer import machines_answer, plan_answer

    try:
        raw, cfg, _ = config_of(request, files)
        options = request.get("plan", {}) or {}
        if not isinstance(options, dict):
            raise RequestError("'plan' must be an object of plan options (top, tokens, gpu_options, max_gpus, prices)")
        if options.get("tokens") not in (None, ""):
            return machines_answer(raw, cfg, tokens=_number("tokens", options["tokens"]),
                                   gpu_options=str(options.get("gpu_options") or ""),
                                   max_gpus=_integer("max_gpus", options.get("max_gpus") or cfg.hardware.num_gpus),
                                   prices=str(options.get("prices") or ""), progress=progress, cancelled=cancelled)
        return plan_answer(raw, cfg, top=_integer("top", options.get("top") or 10), progress=progress,
                           cancelled=cancelled)
    except ConfigError as err:
        return error_answer(err)


def _number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--{name.replace('_', '-')} {str(value)[:40]!r}: must be a number, e.g. 2e12") from None
    if not number == number or number in (float("inf"), float("-inf")):
        raise ConfigError(f"--{name.replace('_', '-')} {value!r}: must be a finite number, e.g. 2e12")
    return number


def _integer(name: str, value: Any) -> int:
    number = _number(name, value)
    if number != int(number) or abs(number) > 1 << 31:
        raise ConfigError(f"--{name.replace('_', '-')} {value!r}: must be a whole number, e.g. 10")
    return int(number)


def defaults() -> dict[str, Any]:
    """The defaults' config as the page starts from it (every field's value as text)."""
    return {f"{s}.{f.name}": getattr(getattr(Config(), s), f.name) for s, cls in SECTIONS.items()
            for f in dataclasses.fields(cls)}
