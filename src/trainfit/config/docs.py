"""The config documents itself: each field's attribute docstring, read from the schema's source,
is what `trainfit train --help` prints, so the schema is the one place a field is explained."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Iterator
from typing import Any

from trainfit.config.schema import SECTIONS, Config


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass (the string literal under each field)."""
    return dict(_module_field_docs(cls.__module__).get(cls.__qualname__, {}))


@functools.cache
def _module_field_docs(module: str) -> dict[str, dict[str, str]]:
    """Field docs of every class of a module, from one parse of its source (parsing per class cost
    0.25 s of every `trainfit estimate`: --help text is built for each subcommand)."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(sys.modules[module])).body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {
                field.target.id: " ".join(str(doc.value.value).split())
                for field, doc in zip(node.body, node.body[1:], strict=False)
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            }
    return docs


def iter_fields() -> Iterator[tuple[str, str, Any, str]]:
    """(section, field, default, doc) for every field of every section, for --help."""
    defaults = Config()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, getattr(getattr(defaults, section), f.name), docs.get(f.name, "")


def field_kind(hint: Any) -> tuple[str, list[str]]:
    """(kind, choices) of a field's annotation: bool, int, float, str, list, or choice with its choices;
    an Optional field (None: from the model preset) by its type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        return field_kind(args[0]) if len(args) == 1 else ("str", [])
    if typing.get_origin(hint) is typing.Literal:
        return "choice", [str(a) for a in typing.get_args(hint)]
    if typing.get_origin(hint) is tuple:
        return "list", []
    return {bool: "bool", int: "int", float: "float"}.get(hint, "str"), []


def config_reference() -> str:
    """Every field of every section as Markdown tables (field, default, type, help): the documentation
    site's config reference, from the same docstrings as `--help`."""
    hints = {section: typing.get_type_hints(cls) for section, cls in SECTIONS.items()}
    lines: list[str] = []
    current = ""
    for section, name, default, doc in iter_fields():
        if section != current:
            current = section
            lines += ["", f"## [{section}]", "", "| field | default | type | what it does |",
                      "| --- | --- | --- | --- |"]
        kind, choices = field_kind(hints[section][name])
        shown = "from the preset" if default is None else f"`{_toml_value(default)}`"
        what = " \\| ".join(f"`{c}`" for c in choices) if choices else kind
        lines.append(f"| `{section}.{name}` | {shown} | {what} | {_cell(doc)} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: pipes escaped."""
    return text.replace("|", "\\|")
