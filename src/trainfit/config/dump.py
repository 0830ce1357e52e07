"""TOML out, written atomically: a config (`trainfit plan --out`) or a hardware profile (`trainfit
calibrate`) that tomllib, which only reads, reads back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainfit.config.schema import ConfigError


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # exact, and valid TOML (1e-05, 15000000000.0, inf)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def _is_tables(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def _table(table: dict[str, Any], path: str) -> list[str]:
    """Scalars and arrays first, then sub-tables, then arrays of tables, as TOML requires."""
    lines = [f"{k} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict) and not _is_tables(v)]
    for key, value in table.items():
        name = f"{path}.{key}" if path else key
        if isinstance(value, dict) and value:
            lines += ["", f"[{name}]", *_table(value, name)]
        elif _is_tables(value):
            for item in value:
                lines += ["", f"[[{name}]]", *_table(item, name)]
    return lines


def dump_toml(data: dict[str, Any], header: str = "") -> str:
    """Nested dicts (tables), lists of dicts (arrays of tables) and values as TOML, in the order
    given (empty tables left out); `header` becomes leading comment lines."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()] + _table(data, "")
    return "\n".join(lines).lstrip("\n") + "\n"


def check_writable(option: str, path: str | Path, *, replace: bool = True,
                   kind: tuple[str, Callable[[Path], bool]] | None = None) -> None:
    """Fail before any work when a file could not be written at `path` (given by `option`), or, with
    replace=False, when one is there already. With `kind` (its name, and whether a file is one), a
    file there is replaced, and --force suggested, only when it is of that kind."""
    out = Path(path)
    parent = out.absolute().parent
    if out.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a folder; give a file name such as {out / 'plan.toml'}")
    if not parent.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{option} {str(path)!r}: cannot write in the folder {str(parent)!r}; choose another")
    if not out.exists():
        return
    if kind is not None and not kind[1](out):
        raise ConfigError(f"{option} {str(path)!r}: a file that is not a {kind[0]} is there; choose another {option} "
                          f"(only a {kind[0]} is ever replaced)")
    if not replace:
        raise ConfigError(f"{option} {str(path)!r}: the file exists; pass --force to replace it, or choose another "
                          f"{option}")


def write_atomic(path: str | Path, text: str) -> Path:
    """Write a text file whole or not at all: a temporary file beside it (the umask's permissions),
    flushed to disk, then renamed over it."""
    out = Path(path)
    check_writable("file", out)
    temp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, out)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return out
