"""A config as TOML text that load_config reads back (`trainfit plan --out`): tomllib only reads."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from trainfit.config.schema import ConfigError


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def dump_toml(raw: dict[str, dict[str, Any]], header: str = "") -> str:
    """Nested dicts (section -> field -> value) as TOML, sections in the order given; `header`
    becomes leading comment lines."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, values in raw.items():
        if not values:
            continue
        lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
        lines += [f"{name} = {_value(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


def check_writable(option: str, path: str | Path) -> None:
    """Fail before any work when a file could not be written at `path` (given by `option`)."""
    out = Path(path)
    if out.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a folder; give a file name such as plan.toml")
    if not out.absolute().parent.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: the folder {str(out.absolute().parent)!r} does not exist; "
                          "create it first")


def write_atomic(path: str | Path, text: str) -> Path:
    """Write a text file whole or not at all: a temporary file beside it, flushed, then renamed over it."""
    out = Path(path)
    check_writable("file", out)
    fd, temp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.absolute().parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, out)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return out
