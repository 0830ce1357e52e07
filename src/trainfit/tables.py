"""Tables as every command prints them, whole: a number is never split across lines.

Rich wraps a table that is wider than its console cell by cell, digits included ("3,075,5" over
"73"), and a console that is not a terminal (a pipe, a file, a CI log) is 80 columns wide. So a table
is printed at its natural width when the output is not a terminal (nothing there wraps it), at its
natural width in a terminal that holds it, and otherwise as a list: one block per row, each column's
header and value on a line of its own ("tokens/s: 3,075,573")."""

from __future__ import annotations

import io

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def natural_width(table: Table) -> int:
    """Columns the table takes when nothing limits it."""
    probe = Console(width=100_000, file=io.StringIO())
    return Measurement.get(probe, probe.options, table).maximum


def print_table(table: Table, console: Console | None = None) -> None:
    """Print `table` whole (see the module docstring)."""
    console = console or Console()
    width = natural_width(table)
    if width <= console.width:
        console.print(table)
    elif not console.is_terminal:
        narrow = console.width
        console.width = width  # a file or pipe: as wide as the table
        try:
            console.print(table)
        finally:
            console.width = narrow
    else:
        console.print(as_list(table))


def _plain(cell: RenderableType) -> str:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    out = Console(width=100_000, file=io.StringIO(), color_system=None)
    with out.capture() as captured:
        out.print(cell)
    return captured.get().strip()


def as_list(table: Table) -> Text:
    """The table as blocks of `header: value` lines, one block per row, under its title."""
    headers = [" ".join(_plain(column.header).split()) for column in table.columns]
    columns = [[_plain(cell) for cell in column.cells] for column in table.columns]
    lines = [_plain(table.title)] if table.title else []
    for row in zip(*columns, strict=True):
        lines.append("")
        lines.extend(f"{header}: {' '.join(value.split())}" if header else ' '.join(value.split())
                     for header, value in zip(headers, row, strict=True) if value.strip())
    if table.caption:
        lines += ["", _plain(table.caption)]
    return Text("\n".join(lines))


def say_derived(notes: list[str], *, stderr: bool = False) -> None:
    """The defaults derived from the model and the device (configure/defaults.py), one a line, wrapped
    between words in a terminal."""
    console = Console(stderr=stderr, soft_wrap=not Console(stderr=stderr).is_terminal)
    console.print("defaults for this model and device (set a field to change it):", highlight=False)
    for note in notes:
        console.print(f"  - {note}", highlight=False)
