"""Errors in the predicted-vs-measured table: percentages only where the figure is worth one."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.compare import Comparison, comparison_table

MiB = 2**20


def _comparison() -> Comparison:
    measured = MemoryBreakdown(activations=80 * MiB, logits=12, buffers=20 * MiB - 12, peak=100 * MiB)
    analytic = MemoryBreakdown(activations=88 * MiB, logits=0, buffers=22 * MiB, peak=110 * MiB)
    return Comparison({"analytic": analytic, "measured": measured})


def test_errors_are_relative_to_the_measured_component() -> None:
    cmp = _comparison()
    assert cmp.error("analytic", "activations") == pytest.approx(0.10)
    assert cmp.error("analytic", "peak") == pytest.approx(0.10)


def test_no_percentage_for_components_too_small_to_matter_or_unknown_sources() -> None:
    cmp = _comparison()
    assert cmp.error("analytic", "logits") is None  # 12 bytes of loss scalars at a 100 MiB peak
    assert cmp.error("analytic", "params") is None  # zero
    assert cmp.error("traced", "peak") is None
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(comparison_table(cmp))
    lines = {line.split()[1]: line for line in console.export_text().splitlines() if line.startswith("│")}
    assert "+10.0%" in lines["activations"] and "%" not in lines["logits"]
