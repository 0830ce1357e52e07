"""Fine-tuning records: the formats fine-tuners' data comes in, read from JSON Lines, JSON or Parquet files
(dataset hubs' format: streamed in row groups) and brought to one form, a conversation (or, for plain
text, the text).

- chat: {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}
  (OpenAI's format, TRL's conversational one);
- prompt-completion: {"prompt": "...", "completion": "..."}, strings (trained on the completion) or
  message lists (TRL's conversational prompt-completion: trained on the completion's turns);
- alpaca: {"instruction": "...", "input": "..." (optional), "output": "..."}: a user turn (the
  instruction, and the input after a blank line) and the assistant's answer, as torchtune's
  AlpacaToMessages makes them;
- text: {"text": "..."}: trained on all of it.

`data.format=auto` tells each file's format from its first record; every record of a file then has
that format's fields, or is a named error with its file and line. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError

FORMATS = ("text", "chat", "prompt-completion", "alpaca")
ROLES = ("system", "user", "assistant", "tool")
_FIELDS = {"chat": ("messages",), "prompt-completion": ("prompt", "completion"), "alpaca": ("instruction", "output"),
           "text": ("text",)}
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Record:
    """One sample: a conversation (messages, of which the turns from `trained_from` on are trained: 0 for
    all of them), or a text whose characters from `text_trained_from` on are trained."""

    where: str
    """file:line (or file[index]), for messages."""
    messages: tuple[dict[str, Any], ...] = ()
    trained_from: int = 0
    """The first message whose assistant turns the loss trains on (a conversational prompt-completion's
    completion)."""
    text: str | None = None
    text_trained_from: int = 0
    """Of a text: the first trained character (a string prompt-completion's completion)."""


def detect_format(record: Any, where: str) -> str:
    """The format of a record from its fields (module docstring)."""
    if isinstance(record, dict):
        for name, fields in _FIELDS.items():
            if name != "text" and all(f in record for f in fields):
                return name
        if "text" in record:
            return "text"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(f"data.path: {where!r} has none of the formats' fields (got {keys}); write "
                      '{"messages": [...]}, {"prompt": ..., "completion": ...}, {"instruction": ..., "output": ...} '
                      'or {"text": ...} records, or set data.format')


def read_records(path: Path, fmt: str = "auto") -> Iterator[Record]:
    """The records of a .jsonl (one object a line) or .json (an array of objects) file, in order."""
    file_format = None if fmt == "auto" else fmt
    for where, raw in _raw_records(path):
        if file_format is None:
            file_format = detect_format(raw, where)
        yield to_record(raw, file_format, where)


def first_record(path: Path) -> tuple[str, Any] | None:
    """(where, the raw record) of a file's first record, or None for an empty file."""
    return next(_raw_records(path), None)


def _raw_records(path: Path) -> Iterator[tuple[str, Any]]:
    if path.suffix == ".parquet":
        yield from _parquet_records(path)
        return
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError(f"data.path: {str(path)!r} is not UTF-8 JSON ({err}); write an array of records, "
                              'or JSON Lines (one {"messages": [...]} object a line) in a .jsonl file') from err
        if not isinstance(data, list):
            raise ConfigError(f"data.path: {str(path)!r} holds a JSON {type(data).__name__}, not an array of "
                              "records; write [{...}, {...}] or use a .jsonl file")
        yield from ((f"{path}[{i}]", record) for i, record in enumerate(data))
        return
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line.decode("utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ConfigError(f"data.path: {where!r} is not a UTF-8 JSON object ({err}); write one "
                                  'record per line, e.g. {"messages": [{"role": "user", "content": "..."}, ...]}'
                                  ) from err


PARQUET_BATCH_ROWS = 1024
"""Rows read from a Parquet file at a time: the file is streamed, never loaded whole."""


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    """A Parquet file's rows as records (its columns the fields; a messages column of structs gives the
    message dicts), read PARQUET_BATCH_ROWS at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ConfigError(f"data.path: {str(path)!r} is a Parquet file, which needs pyarrow: pip install "
                          "'trainfit[parquet]' (or convert the file to JSON Lines)") from err
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and OSError on a file that is not Parquet
        raise ConfigError(f"data.path: {str(path)!r} is not a readable Parquet file ({err}); write it with a "
                          "Parquet writer (pandas, pyarrow, datasets) or convert it to JSON Lines") from err
    row = 0
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for record in batch.to_pylist():
            yield f"{path}[row {row}]", {key: value for key, value in record.items() if value is not None}
            row += 1


def to_record(raw: Any, fmt: str, where: str) -> Record:
    """A raw JSON record of format `fmt` as a Record; a missing or mistyped field is a named error."""
    if not isinstance(raw, dict):
        raise ConfigError(f"data.path: {where!r} is a JSON {type(raw).__name__}, not an object; write one "
                          "object per record")
    missing = [f for f in _FIELDS[fmt] if f not in raw]
    if missing:
        raise ConfigError(f"data.path: {where!r} lacks {', '.join(repr(f) for f in missing)} of the {fmt} format "
                          f"(its fields: {sorted(raw)}); fix the record, or set data.format to its format")
    if fmt == "text":
        return Record(where, text=_string(raw, "text", where))
    if fmt == "chat":
        return Record(where, messages=_messages(raw["messages"], f"{where} messages"))
    if fmt == "alpaca":
        instruction, output = _string(raw, "instruction", where), _string(raw, "output", where)
        extra = raw.get("input") or ""
        if not isinstance(extra, str):
            raise ConfigError(f"data.path: {where!r}: 'input' is a {type(extra).__name__}, not a string")
        user = f"{instruction}\n\n{extra}" if extra else instruction
        return Record(where, messages=({"role": "user", "content": user}, {"role": "assistant", "content": output}))
    prompt, completion = raw["prompt"], raw["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Record(where, text=prompt + completion, text_trained_from=len(prompt))
    if isinstance(prompt, list) and isinstance(completion, list):
        asked = _messages(prompt, f"{where} prompt", need_assistant=False)
        answered = _messages(completion, f"{where} completion")
        return Record(where, messages=asked + answered, trained_from=len(asked))
    raise ConfigError(f"data.path: {where!r}: 'prompt' and 'completion' must both be strings or both be message "
                      f"lists (got {type(prompt).__name__} and {type(completion).__name__})")


def _string(raw: dict[str, Any], key: str, where: str) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise ConfigError(f"data.path: {where!r}: {key!r} is a {type(value).__name__}, not a string")
    return value


def _messages(value: Any, where: str, need_assistant: bool = True) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"data.path: {where!r} is not a non-empty list of messages; write "
                          '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]')
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f"data.path: {where!r}[{i}] is not a message with a string 'role'")
        if message["role"] not in ROLES:
            raise ConfigError(f"data.path: {where!r}[{i}]: role {message['role']!r} is unknown; use one of "
                              f"{', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise ConfigError(f"data.path: {where!r}[{i}]: 'content' is a {type(content).__name__}, not a string")
        out.append(dict(message))
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise ConfigError(f"data.path: {where!r} has no assistant turn, so nothing to train on; add the "
                          "assistant's answer or remove the record")
    return tuple(out)


def record_files(files: list[Path]) -> list[Path]:
    """The files of `files` that hold records (the rest are plain text)."""
    return [path for path in files if path.suffix in RECORD_SUFFIXES]
