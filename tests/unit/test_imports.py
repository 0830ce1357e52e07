"""The import graph of trainfit has no cycles, between modules or between the package's parts.

Read from the source with `ast`, like shared/tools/import_cycles.py: an import inside a function
counts (a lazy import that closes a cycle is still a cycle), and so does one under `if TYPE_CHECKING:`
(a cycle only annotations close is a type in the wrong module); a package's __init__ importing its own
submodules (and they it) is not a cycle. The parts are the
top-level entries of src/trainfit (config, models, memory, ..., units.py, traced.py): they form
layers, each importing only parts below it (docs/contributing/architecture.md gives the order).
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


def _imported(module: str, file: Path, mods: dict[str, Path], annotations: bool = True) -> set[str]:
    """The trainfit modules `module` imports, anywhere in its body; under TYPE_CHECKING only with
    `annotations`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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


def test_the_finder_counts_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    file = tmp_path / "a.py"
    file.write_text("from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from trainfit.b import B\n"
                    "def f():\n    from trainfit.c import C\n    from . import d\n")
    mods = {name: file for name in ("trainfit.a", "trainfit.b", "trainfit.c", "trainfit.d")}
    assert _imported("trainfit.a", file, mods) == {"trainfit.b", "trainfit.c", "trainfit.d"}
    assert _imported("trainfit.a", file, mods, annotations=False) == {"trainfit.c", "trainfit.d"}
    graph = {"trainfit.a": {"trainfit.c"}, "trainfit.c": {"trainfit.a"}, "trainfit.d": {"trainfit.a"}}
    assert cycles(graph) == {("a", "c")}


def part_of(module: str) -> str:
    """The top-level part a module belongs to: trainfit.memory.closed_form.analytic -> memory, trainfit.units ->
    units; the package itself -> ""."""
    return module.split(".")[1] if "." in module else ""


def part_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """part -> {part it imports: the modules that import it}; a part's imports of itself and
    everything of the package's own __init__ (the public API, which imports down) left out."""
    parts: dict[str, dict[str, set[str]]] = {}
    for module, targets in graph.items():
        src = part_of(module)
        if not src:
            continue
        edges = parts.setdefault(src, {})
        for target in targets:
            dst = part_of(target)
            if dst and dst != src:
                edges.setdefault(dst, set()).add(module.removeprefix(PACKAGE + "."))
    return parts


def part_cycles_message(parts: dict[str, dict[str, set[str]]]) -> str:
    """Each cycle of parts with the imports that close it, or "" when the parts form layers."""
    nodes = set(parts) | {dst for edges in parts.values() for dst in edges}
    found = cycles({p: set(parts.get(p, {})) for p in nodes})
    lines = []
    for cycle in sorted(found):
        lines.append("parts import each other: " + ", ".join(cycle))
        lines += [f"  {src} -> {dst}: imported by {', '.join(sorted(parts[src][dst]))}"
                  for src in cycle for dst in sorted(parts.get(src, {})) if dst in cycle]
    if lines:
        lines.append("move the code that closes the cycle to the layer it belongs in "
                     "(docs/contributing/architecture.md), or import it under `if TYPE_CHECKING:` if only "
                     "annotations need it")
    return "\n".join(lines)


def test_the_parts_form_layers() -> None:
    message = part_cycles_message(part_graph(import_graph()))
    assert not message, message


def test_a_part_cycle_names_the_importing_modules() -> None:
    graph = {"trainfit.a.x": {"trainfit.b"}, "trainfit.b": {"trainfit.a.y", "trainfit.c"},
             "trainfit.a.y": {"trainfit.a.x"}, "trainfit.c": set(), "trainfit": {"trainfit.a.x"}}
    parts = part_graph(graph)
    assert parts == {"a": {"b": {"a.x"}}, "b": {"a": {"b"}, "c": {"b"}}, "c": {}}
    message = part_cycles_message(parts)
    assert message.splitlines()[:3] == ["parts import each other: a, b", "  a -> b: imported by a.x",
                                         "  b -> a: imported by b"]
    assert part_cycles_message({"a": {"b": {"a"}}, "b": {}}) == ""


def test_config_imports_nothing_of_trainfit_outside_config() -> None:
    """config is the bottom layer: the schema and its helpers. Loading a file, which resolves model
    presets and checks the hardware, is trainfit.configure's, above models and hardware."""
    outside = {m: sorted(t for t in targets if part_of(t) not in ("config", ""))
               for m, targets in import_graph().items() if part_of(m) == "config"}
    assert not any(outside.values()), {m: t for m, t in outside.items() if t}


def test_the_schema_is_the_bottom_layer() -> None:
    """schema.py imports nothing of trainfit's; the modules trainfit.configure imports (hardware,
    models) take only the schema from config."""
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


MEMORY_FACES = ("trainfit.memory", "trainfit.memory.closed_form", "trainfit.memory.traced", "trainfit.memory.measured")


def test_outside_memory_only_its_public_faces_are_imported() -> None:
    """memory/ is organised by job (memory/__init__.py): the rest of the package imports its four faces,
    never a module inside them, so a module there can move or split without touching its users."""
    inside = {m: sorted(t for t in targets if t.startswith("trainfit.memory") and t not in MEMORY_FACES)
              for m, targets in import_graph().items() if not m.startswith("trainfit.memory")}
    assert not any(inside.values()), {m: t for m, t in inside.items() if t}


def test_each_memory_face_names_only_what_it_holds() -> None:
    """Every name a face lists in __all__ resolves, and its classes and functions come from the face's own
    package (`trainfit.memory`'s from its top modules)."""
    import importlib

    for face in MEMORY_FACES:
        module = importlib.import_module(face)
        for name in module.__all__:
            origin = getattr(getattr(module, name), "__module__", "builtins")
            if origin not in ("builtins", "typing"):  # constants and type aliases name no module
                assert origin.startswith(face + "."), (face, name, origin)
                assert face != "trainfit.memory" or origin.count(".") == 2, (name, origin)
