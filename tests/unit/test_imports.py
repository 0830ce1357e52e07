"""The import graph of trainfit has no cycles, and config's layers depend one way.

Read from the source with `ast`, like shared/tools/import_cycles.py: an import inside a function
counts (a lazy import that closes a cycle is still a cycle); one under `if TYPE_CHECKING:` does not;
a package's __init__ importing its own submodules (and they it) is not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[2] / "src"
PACKAGE = "trainfit"

def _modules() -> dict[str, Path]:
    mods = {}
    for file in (SRC / PACKAGE).rglob("*.py"):
        parts = list(file.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = file
    return mods


def _imported(module: str, file: Path, mods: dict[str, Path]) -> set[str]:
    """The trainfit modules `module` imports, anywhere in its body except under TYPE_CHECKING."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(file.read_text()))
    return {m for m in found if m in mods and m != module}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: _imported(m, f, mods) for m, f in mods.items()}
    for m, targets in graph.items():  # a package and its own submodules
        graph[m] = {t for t in targets if not t.startswith(m + ".") and not m.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module, names relative to the package."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {m: reachable(m) for m in graph}
    components = {tuple(sorted(w.removeprefix(PACKAGE + ".") for w in reach[m] if m in reach[w])) for m in graph}
    return {c for c in components if len(c) > 1}


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, f"import cycles: {sorted(found)}"


def test_the_finder_counts_lazy_imports_and_skips_type_checking(tmp_path: Path) -> None:
    file = tmp_path / "a.py"
    file.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from trainfit.b import B\n"
                    "def f():\n    from trainfit.c import C\n    from . import d\n")
    mods = {name: file for name in ("trainfit.a", "trainfit.b", "trainfit.c", "trainfit.d")}
    assert _imported("trainfit.a", file, mods) == {"trainfit.c", "trainfit.d"}
    graph = {"trainfit.a": {"trainfit.c"}, "trainfit.c": {"trainfit.a"}, "trainfit.d": {"trainfit.a"}}
    assert cycles(graph) == {("a", "c")}


def test_the_schema_is_the_bottom_layer() -> None:
    """schema.py imports nothing of trainfit's; what validation imports (hardware, models) takes
    only the schema from config, so loading and validation sit above them, never below."""
    graph = import_graph()
    assert graph["trainfit.config.schema"] == set()
    below_validation = ["trainfit.hardware"] + [m for m in graph if m == "trainfit.models" or
                                                m.startswith("trainfit.models.")]
    for module in below_validation:
        config_imports = {t for t in graph[module] if t == "trainfit.config" or t.startswith("trainfit.config.")}
        assert config_imports <= {"trainfit.config.schema"}, f"{module} imports {config_imports}"


def test_memory_never_imports_the_trainer() -> None:
    """The memory meter and the traced estimator run the trainer's step (train/step.py) without
    knowing the trainer: nothing under memory/ names train.trainer or train.loop, not even for types."""
    for file in (SRC / PACKAGE / "memory").rglob("*.py"):
        names = {node.module for node in ast.walk(ast.parse(file.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.module}
        names |= {alias.name for node in ast.walk(ast.parse(file.read_text())) if isinstance(node, ast.Import)
                  for alias in node.names}
        assert not names & {"trainfit.train.trainer", "trainfit.train.loop"}, file
