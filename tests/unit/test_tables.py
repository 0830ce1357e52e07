"""trainfit/tables.py, which every command's tables go through (estimate, plan, report, measure,
calibrate, validate, train's summary): a table is never printed with a number split across lines."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.table import Table

from trainfit.tables import natural_width, print_table

NUMBERS = ["3,075,573", "1,195,295", "$81,887", "57.2%", "12.3 days"]


def wide_table() -> Table:
    table = Table(title="devices by time to train")
    for column in ("device", "GPUs", "layout", "tokens/s", "cost", "MFU", "time to train"):
        table.add_column(column, justify="right", overflow="fold")
    table.add_row("H100-SXM-80GB", "256", "HSDP 32x8 (ZeRO-3); no checkpointing, chunked loss", *NUMBERS[:1], "$81,887",
                  "57.2%", "12.3 days")
    table.add_row("MI300X", "128", "HSDP 16x8 (ZeRO-3); no checkpointing", "1,195,295", "$59,195", "36.8%", "9.7 days")
    return table


def printed(console: Console) -> str:
    print_table(wide_table(), console)
    return console.file.getvalue()


def test_piped_a_table_prints_at_its_own_width() -> None:
    text = printed(Console(file=io.StringIO(), width=80))
    assert natural_width(wide_table()) > 80
    assert max(len(line) for line in text.splitlines()) == natural_width(wide_table())
    for number in NUMBERS:
        assert number in text
    assert len([line for line in text.splitlines() if "│" in line]) == 2  # one line per row


def test_in_a_narrow_terminal_a_table_prints_as_header_value_blocks() -> None:
    text = printed(Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "tokens/s: 3,075,573" in text and "tokens/s: 1,195,295" in text and "GPUs: 128" in text
    assert not re.search(r"\d,?\n\s*\d", text)  # no number continued on the next line


def test_a_table_that_fits_the_terminal_prints_as_a_table() -> None:
    text = printed(Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None))
    assert "┃" in text and "3,075,573" in text
