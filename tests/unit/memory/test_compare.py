"""Errors in the predicted-vs-measured table: percentages only where the figure is worth one."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from trainfit.memory import MemoryBreakdown
from trainfit.memory.compare import NON_TENSOR_NOTE_SHARE, Comparison, comparison_table

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


def _rendered(cmp: Comparison) -> tuple[dict[str, list[str]], str]:
    """The table's rows as their cells, by the first one; and the whole text."""
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(comparison_table(cmp))
    text = console.export_text()
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    return {cells[0]: cells for cells in rows}, text


def test_memory_outside_tensors_is_a_measured_row_apart_and_explained_when_large() -> None:
    cmp = _comparison()
    outside = int(NON_TENSOR_NOTE_SHARE * cmp.sources["measured"].peak)
    cmp.sources["measured"] = dataclasses.replace(cmp.sources["measured"], non_tensor=outside + MiB)
    rows, text = _rendered(cmp)
    assert rows["non_tensor"] == ["non_tensor", "", "6.0 MiB", ""]  # measured only, no error in percent
    assert rows["peak"] == ["peak", "110.0 MiB", "100.0 MiB", "+10.0%"]  # the estimate against the tensors' peak
    assert "6.0 MiB in use outside tensors" in text and "not estimated" in text and "process peak 106.0 MiB" in text
    cmp.sources["measured"] = dataclasses.replace(cmp.sources["measured"], non_tensor=outside - 1)
    rows, text = _rendered(cmp)
    assert "non_tensor" in rows and "outside tensors" not in text  # small: the row, no note


def test_cuda_figures_are_measured_rows_and_say_where_they_are_not_available() -> None:
    cmp = _comparison()
    rows, _ = _rendered(cmp)  # a CPU measurement: no reserved or device-used figure
    assert rows["reserved peak"] == ["reserved peak", "", "n/a (CUDA only)", ""]
    assert rows["device used"] == ["device used", "", "n/a (CUDA only)", ""]
    cmp.sources["measured"] = dataclasses.replace(cmp.sources["measured"], reserved_peak=128 * MiB,
                                                  device_used=700 * MiB)
    rows, _ = _rendered(cmp)
    assert rows["reserved peak"] == ["reserved peak", "", "128.0 MiB", ""]
    assert rows["device used"] == ["device used", "", "700.0 MiB", ""]


def _timeline(phases: list[tuple[str, int]], peak_at: int) -> list[tuple[float, int, str, str]]:
    """A timeline of `count` points per phase, rising to a peak at point `peak_at`."""
    names = [phase for phase, count in phases for _ in range(count)]
    return [(i, (100 - abs(i - peak_at)) * MiB, phase, f"op{i}") for i, phase in enumerate(names)]


def test_the_timeline_shades_each_sources_phases_and_keeps_peak_labels_apart(tmp_path) -> None:
    """Two sources whose peaks sit a hair apart, with phases that do not line up: each source gets a
    strip of its own phases, and the peaks are described in the legend, never as overlapping text."""
    from trainfit.memory import compare

    traced = _timeline([("forward", 40), ("backward", 50), ("optimizer", 10)], peak_at=45)
    measured = _timeline([("forward", 30), ("backward", 60), ("optimizer", 10)], peak_at=46)
    cmp = Comparison({"traced": MemoryBreakdown(peak=100 * MiB), "measured": MemoryBreakdown(peak=100 * MiB)},
                     {"traced": traced, "measured": measured})
    drawn = {}

    def keep(fig, path):
        drawn["fig"] = fig
        return path

    original = compare.save_figure
    compare.save_figure = keep
    try:
        compare.plot_comparison(cmp, tmp_path / "report.png")
    finally:
        compare.save_figure = original
    ax = drawn["fig"].axes[0]
    assert ax.texts and all("peak" not in t.get_text() for t in ax.texts)  # no peak text in the plot
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("traced: peak 100 MiB in backward (op45)") for t in legend)
    assert any(t.startswith("measured: peak 100 MiB in backward (op46)") for t in legend)
    assert compare.phase_runs(traced) == [(0, 39, "forward"), (40, 89, "backward"), (90, 99, "optimizer")]
    spans = [p for p in ax.patches if p.get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    strips = {round(p.get_y(), 3) for p in spans}
    assert len(spans) >= 6 and len(strips) == 2  # three phases per source, in two separate strips
