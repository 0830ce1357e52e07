"""MkDocs hooks: the pages' generated parts, written at build time from the code and the commands, so
that nothing the site shows is typed by hand. A page asks for one with an HTML comment on a line of
its own:

- `<!-- generated: config-reference -->`: every config field (trainfit.config.docs.config_reference);
- `<!-- generated: json-reference -->`: the keys of estimate's and plan's JSON (plan/answer_schema.py);
- `<!-- help: COMMAND -->`: `trainfit COMMAND --help`, as a text block;
- `<!-- output: SHELL COMMAND -->`: the command run in the repository root, its output as a text block
  (a pipeline's filters, after " | ", choose the part shown and are not shown);
- `<!-- markdown: SHELL COMMAND -->`: the same, its output taken as Markdown (a benchmark's table).

A command that fails fails the build. `<!-- runnable -->` above a ```bash block marks it for
tests/test_docs.py, which runs it; this hook leaves it as it is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (generated|help|output|markdown): (.+?) -->$", re.MULTILINE)
WIDTH = "100"
"""Terminal columns the commands' tables are printed at."""


def _run(command: str) -> str:
    env = {**os.environ, "COLUMNS": WIDTH, "TERM": "dumb", "NO_COLOR": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"docs: `{command}` failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout.rstrip() + "\n"


def _generated(name: str) -> str:
    if name == "config-reference":
        from trainfit.config.docs import config_reference

        return config_reference()
    if name == "models-reference":
        from trainfit.models.reference import models_reference

        return models_reference()
    if name == "json-reference":
        from trainfit.plan.answer_schema import json_reference

        return json_reference()
    raise RuntimeError(f"docs: no generated part named {name!r}")


def _help(command: str) -> str:
    """A command's --help at WIDTH columns, without the config fields it lists after its options (the
    config reference has them, and the page says so)."""
    from trainfit.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = actions[0].choices[command]
    takes_fields = bool(parser.epilog and parser.epilog.startswith("config fields"))
    if takes_fields:
        parser.epilog = None
    os.environ["COLUMNS"] = WIDTH
    note = ("\n\nIt also takes every config field as `--section.field=value` after CONFIG: the [config "
            "reference](../reference/config.md) lists them.") if takes_fields else ""
    return f"```text\n$ trainfit {command} --help\n{parser.format_help().rstrip()}\n```{note}"


def _replace(match: re.Match[str]) -> str:
    kind, what = match.group(1), match.group(2).strip()
    if kind == "generated":
        return _generated(what)
    if kind == "help":
        return _help(what)
    if kind == "output":  # a pipeline's filters pick the part shown: the command is shown without them
        shown, _, filters = what.partition(" | ")
        return f"```text\n$ {shown}\n{'...' + chr(10) if filters else ''}{_run(what)}```"
    return _run(what)


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(_replace, markdown)
