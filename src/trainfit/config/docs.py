"""The config documents itself: each field's attribute docstring, read from the schema's source,
is what `trainfit train --help` prints, so the schema is the one place a field is explained."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

from trainfit.config.schema import SECTIONS, Config


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass (the string literal under each field)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def iter_fields() -> Iterator[tuple[str, str, Any, str]]:
    """(section, field, default, doc) for every field of every section, for --help."""
    defaults = Config()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            yield section, f.name, getattr(getattr(defaults, section), f.name), docs.get(f.name, "")
