"""Which of the server's files a request may make it read: none, unless the user who started it said so.

A request names a model by preset name or by content (an uploaded config.json becomes model fields,
an uploaded hardware profile a file in the server's own folder). Three config fields are read from
disk by estimate and plan, and a request's value of one is refused unless it lies inside a folder
given with `trainfit serve --files DIR` (after resolving `..` and symlinks), or is a file the start
config names itself, and is of the kind the field reads:

| field            | reads                                          | kind                             |
|------------------|------------------------------------------------|----------------------------------|
| model.preset     | an HF config.json (a preset name reads nothing) | a *.json file, or a folder's config.json |
| model.init_from  | a folder's config.json (the weights only listed)| a folder holding config.json     |
| hardware.profile | a profile written by `trainfit calibrate`       | a *.toml file                    |

The client gets one message for every refusal, whether the path is outside the folders, missing,
unreadable or of another kind, and never a file's content: what went wrong goes to the server's log.
A relative path is the command line's, relative to the folder the server was started in.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError


class RequestError(ValueError):
    """A request that is not a config, or asks for what the server does not do: answered with HTTP 400,
    this message and, where one field is the cause, that field (the page shows it there)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class PathField:
    key: str
    """section.field"""
    kind: str
    """What the field reads, in the words of the message."""
    fix: str
    """What the page offers instead."""


PATH_FIELDS = (
    PathField("model.preset", "Hugging Face config.json",
              "pick a preset, or upload the config.json (the page turns it into model fields)"),
    PathField("model.init_from", "folder of Hugging Face weights",
              "estimate from its config.json instead (upload it), or start the server with --files on a folder "
              "holding the weights"),
    PathField("hardware.profile", "hardware profile (.toml)", "upload the profile file instead"),
    PathField("data.path", "fine-tuning data (a prepared folder, or records)",
              "leave data.path empty (the estimate then prices rows of text), or start the server with --files on "
              "the data's folder"),
)
"""The config fields whose value is a path the server would read (estimate and plan read no other)."""
MAX_FILE = 1 << 20
"""Bytes of a file the server reads for a request (a config.json or a profile is a few KiB)."""
UPLOAD = re.compile(r"profile-[0-9a-f]{16}\.toml")
"""The name of a hardware profile uploaded to the server's own folder (serve/api.hardware_profile)."""


def log(message: str) -> None:
    """The server's log (its terminal): what the client is not told."""
    print(f"trainfit serve: {message}", file=sys.stderr, flush=True)


@dataclass
class FilePolicy:
    """The folders and files a request's path fields may name; everything else is refused."""

    folders: tuple[str, ...] = ()
    """`--files` folders, resolved."""
    folder_names: tuple[str, ...] = ()
    """The same folders as given (absolute, `..` collapsed): a path under one of these or of `folders`
    is looked at further, any other refused without touching the disk."""
    start_files: frozenset[tuple[str, str]] = frozenset()
    """(field, path) that the start config names, as written (absolute) and resolved: the user chose
    them on the command line."""
    uploads: str = ""
    """The server's folder of uploaded hardware profiles, resolved."""

    @classmethod
    def of(cls, folders: Iterable[str | Path], start_raw: dict[str, Any], uploads: str | Path) -> FilePolicy:
        """The policy of a server started with these --files folders and this start config (raw tables)."""
        given = [str(folder) for folder in folders]
        for folder in given:
            if not os.path.isdir(folder):
                raise ConfigError(f"--files {folder!r}: not a folder; give a folder of config.json files, "
                                  "weights or hardware profiles that the page's users may use")
        start = frozenset((f.key, form(value)) for f in PATH_FIELDS for form in (_lexical, os.path.realpath)
                          if isinstance(value := _value(start_raw, f.key), str) and _is_path(f.key, value))
        return cls(tuple(os.path.realpath(f) for f in given), tuple(_lexical(f) for f in given), start,
                   os.path.realpath(uploads))

    def check(self, raw: dict[str, Any]) -> None:
        """Refuse (RequestError) a request whose config names a path this server may not read, or one
        it may but that is not of its field's kind (read once here, as the estimate will read it)."""
        for f in PATH_FIELDS:
            value = _value(raw, f.key)
            if not isinstance(value, str) or not _is_path(f.key, value):
                continue
            reason = self._refusal(f, value)
            if reason is not None:
                log(f"refused {f.key}={value[:200]!r}: {reason}")
                raise RequestError(self.message(f, value), f.key)

    def message(self, f: PathField, value: str) -> str:
        """The one answer to every refused path of field `f`: nothing in it depends on the disk."""
        where = (f"inside the folder{'s' if len(self.folders) > 1 else ''} it was started with "
                 "(`trainfit serve --files DIR`)") if self.folders else \
            "that its start config names (`trainfit serve --files DIR` lets the page use a folder's files)"
        return f"{f.key}={value[:200]!r}: not a {f.kind} this server may read: it reads only those {where}; {f.fix}"

    def _roots(self, f: PathField) -> tuple[str, ...]:
        return self.folders + ((self.uploads,) if f.key == "hardware.profile" and self.uploads else ())

    def _refusal(self, f: PathField, value: str) -> str | None:
        """Why the server may not read `value` for field `f`, or None when it may (the log's words)."""
        if "\x00" in value:
            return "a NUL character in the path"
        check, roots = _KIND_CHECKS[f.key], self._roots(f)
        lexical = _lexical(value)
        if (f.key, lexical) not in self.start_files and not any(_inside(lexical, root)
                                                                for root in roots + self.folder_names):
            return "outside the --files folders"  # said without looking at the disk
        real = os.path.realpath(value)
        if (f.key, real) in self.start_files:  # the user's own choice: read as the command line reads it
            return _opens_as_resolved(value, real) or _kind_refusal(f, check, real, lambda _: True)
        if not any(_inside(real, root) for root in roots):
            return f"resolves to {real}, outside the --files folders"
        if (why := _opens_as_resolved(value, real)) is not None:
            return why
        if f.key == "hardware.profile" and _inside(real, self.uploads) and not UPLOAD.fullmatch(Path(real).name):
            return "in the server's folder of uploads, but not an uploaded profile"
        return _kind_refusal(f, check, real, lambda path: any(_inside(os.path.realpath(path), r) for r in roots))


def _opens_as_resolved(value: str, real: str) -> str | None:
    """Why the path as given (which the estimate opens) is not the file it resolves to, or None."""
    try:
        return None if os.path.samefile(value, real) else f"resolves to {real}, but opens another file"
    except OSError as err:
        return f"cannot be opened as given ({err.strerror})"


def _lexical(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _kind_refusal(f: PathField, check: KindCheck, real: str, may_read: Callable[[str], bool]) -> str | None:
    """Why the resolved path is not of the field's kind, reading it as the field reads it."""
    try:
        return check(real, may_read)
    except ConfigError as err:
        return f"not readable as a {f.kind}: {err}"
    except (OSError, ValueError) as err:
        return f"cannot be read ({err})"


def _value(raw: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    table = raw.get(section)
    return table.get(name) if isinstance(table, dict) else None


def _is_path(key: str, value: str) -> bool:
    """Whether a field's value names a file (a preset's name, or "", reads none). A model.preset that is
    neither a preset's name nor written as a path is an unknown preset (ConfigError), said without
    looking on the disk for a folder of that name."""
    if not value:
        return False
    if key == "model.preset":
        from trainfit.models.presets import PRESETS, names_a_file, unknown_preset

        if value not in PRESETS and not names_a_file(value):
            raise unknown_preset(value)
        return value not in PRESETS
    return True


KindCheck = Callable[[str, Callable[[str], bool]], "str | None"]
"""(resolved path, whether a path inside it may be read) -> why it is not of the kind, or None."""


def _small_file(real: str, suffix: str) -> str | None:
    """Why `real` is not a regular file named *suffix of at most MAX_FILE bytes, or None."""
    if not real.endswith(suffix) or not os.path.isfile(real):
        return f"not a {suffix} file"
    return f"larger than {MAX_FILE:,} bytes" if os.path.getsize(real) > MAX_FILE else None


def _preset_file(real: str, may_read: Callable[[str], bool]) -> str | None:
    from trainfit.models.hf import model_fields_from_hf_config

    if os.path.isdir(real):
        inner = os.path.join(real, "config.json")
        return _preset_file(os.path.realpath(inner), may_read) if may_read(inner) else \
            "the folder's config.json resolves outside the --files folders"
    why = _small_file(real, ".json")
    if why is None:
        model_fields_from_hf_config(real)
    return why


def _init_folder(real: str, may_read: Callable[[str], bool]) -> str | None:
    return _preset_file(real, may_read) if os.path.isdir(real) else "not a folder"


def _profile_file(real: str, may_read: Callable[[str], bool]) -> str | None:
    from trainfit.hardware_profile import load_profile

    why = _small_file(real, ".toml")
    if why is None:
        load_profile(real)
    return why


def _data_path(real: str, may_read: Callable[[str], bool]) -> str | None:
    """The estimate reads a data.path's manifest or its first records (train/data.sample_rows_of), no more."""
    return None if os.path.isfile(real) or os.path.isdir(real) else "not a file or folder"


_KIND_CHECKS: dict[str, KindCheck] = {
    "model.preset": _preset_file, "model.init_from": _init_folder, "hardware.profile": _profile_file,
    "data.path": _data_path}
