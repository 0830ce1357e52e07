"""The config documents itself: each field's attribute docstring, read from the schema's source,
is what `trainfit train --help` prints, so the schema is the one place a field is explained."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
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
