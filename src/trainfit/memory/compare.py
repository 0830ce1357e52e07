"""Predicted (analytic, traced) against measured, per component, as a table and as pictures.

`trainfit report` and the end of `trainfit train` use it. The timeline picture is the familiar
memory profile of one step (forward, backward, optimizer) with the peak marked; the bar picture
stacks the three sources' breakdowns side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from trainfit.figures import pyplot, save_figure, stack_bars
from trainfit.memory.breakdown import COMPONENTS, MemoryBreakdown
from trainfit.units import GIB, fmt_bytes

PHASE_COLORS = {"forward": "#C9DEF2", "backward": "#F6D5B5", "optimizer": "#C8E6C8"}
PHASE_STRIP = 0.12
"""Height of the band along the bottom of the timeline (axes fraction) where the phases are shaded."""
SMALL_SHARE = 0.01
"""Components under this share of the reference peak get no error in percent."""
DEVICE_FIGURES = {"reserved_peak": "reserved peak", "device_used": "device used"}
"""Measured on CUDA only (MemoryBreakdown.reserved_peak, device_used): absolute, not components; the
table says n/a where they were not measured (the CPU has no such figures)."""
NON_TENSOR_NOTE_SHARE = 0.05
"""A measured non_tensor figure of at least this share of its peak is explained under the table."""


@dataclass
class Comparison:
    """Breakdowns by source name ("analytic", "traced", "measured"), and timelines where known."""

    sources: dict[str, MemoryBreakdown]
    timelines: dict[str, list[tuple[Any, int, str, str]]] = field(default_factory=dict)

    def error(self, source: str, name: str, reference: str = "measured") -> float | None:
        """Relative error of `source` against `reference` for one component; None if either is
        unknown or the reference component is under SMALL_SHARE of its peak (a percentage of a few
        bytes of loss scalars says nothing about the estimate)."""
        if source not in self.sources or reference not in self.sources:
            return None
        ref_breakdown = self.sources[reference]
        ref = getattr(ref_breakdown, name)
        if not ref or (name != "peak" and ref < SMALL_SHARE * ref_breakdown.peak):
            return None
        return (getattr(self.sources[source], name) - ref) / ref

    def as_dict(self) -> dict[str, Any]:
        return {name: b.as_dict() for name, b in self.sources.items()}


def comparison_table(cmp: Comparison, title: str = "memory per GPU: predicted vs measured") -> Table:
    names = list(cmp.sources)
    reference = "measured" if "measured" in names else None
    table = Table(title=title)
    table.add_column("component", no_wrap=True, min_width=len("master_params"))
    for name in names:
        table.add_column(name, justify="right")
    others = [n for n in names if n != reference] if reference else []
    for name in others:
        table.add_column(f"{name} error", justify="right")
    for component in (*COMPONENTS, "peak"):
        row = [fmt_bytes(getattr(cmp.sources[n], component)) for n in names]
        for n in others:
            err = cmp.error(n, component, reference)
            row.append("" if err is None else f"{err:+.1%}")
        table.add_row(component, *row, style="bold" if component == "peak" else None)
    table.add_row("peak phase", *(cmp.sources[n].peak_phase for n in names))
    if reference:  # measured only: the estimators model tensors
        table.add_row("non_tensor", *(fmt_bytes(cmp.sources[n].non_tensor) if n == reference else "" for n in names))
        for name, label in DEVICE_FIGURES.items():
            value = getattr(cmp.sources[reference], name)
            shown = fmt_bytes(value) if value is not None else "n/a (CUDA only)"
            table.add_row(label, *(shown if n == reference else "" for n in names))
        table.caption = non_tensor_note(cmp.sources[reference])
    return table


def non_tensor_note(measured: MemoryBreakdown) -> str | None:
    """One line on the measured step's memory outside tensors, when it is large (NON_TENSOR_NOTE_SHARE)."""
    if measured.non_tensor < NON_TENSOR_NOTE_SHARE * measured.peak:
        return None
    return (f"{fmt_bytes(measured.non_tensor)} in use outside tensors (library caches such as oneDNN's per-shape "
            "primitives, allocator overhead, what torch.compile'd blocks allocate inside): not estimated; process "
            f"peak {fmt_bytes(measured.peak + measured.non_tensor)}")


def plot_comparison(cmp: Comparison, path: str | Path) -> Path:
    """(a) the step's memory timeline of each source, its peak marked and described in the legend
    (labels in the plot would overlap when peaks are close), each source's phases shaded in a strip
    of its own along the bottom (the sources' phases do not line up); (b) stacked breakdowns."""
    plt = pyplot()
    fig, (ax_time, ax_bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    peak = max(b.peak for b in cmp.sources.values())
    unit, scale = ("GiB", GIB) if peak >= GIB else ("MiB", 1024**2)
    timelines = [(source, points) for source, points in cmp.timelines.items() if points]
    strip = PHASE_STRIP / max(1, len(timelines))
    for i, (source, points) in enumerate(timelines):
        _plot_timeline(ax_time, points, source, scale, unit, strip=(i * strip, (i + 1) * strip))
    ax_time.set_ylim(bottom=-PHASE_STRIP / (1 - PHASE_STRIP) * ax_time.get_ylim()[1])  # room for the strips
    ax_time.set_xlabel("progress through one training step (operators, normalised)")
    ax_time.set_ylabel(f"{unit} in use")
    ax_time.set_title("memory over one step (phases of each source along the bottom)")
    ax_time.legend(loc="upper left", fontsize=8)
    names = list(cmp.sources)
    stack_bars(ax_bars, names, [cmp.sources[n] for n in names], (*COMPONENTS, "non_tensor"), scale)
    ax_bars.set_ylabel(f"{unit} at the peak")
    ax_bars.set_title("breakdown at the peak")
    ax_bars.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    return save_figure(fig, path)


def phase_runs(points: list[tuple[Any, int, str, str]]) -> list[tuple[int, int, str]]:
    """(first index, last index, phase) of each run of one phase along a timeline."""
    runs, start = [], 0
    for i in range(1, len(points) + 1):
        if i == len(points) or points[i][2] != points[start][2]:
            runs.append((start, i - 1, points[start][2]))
            start = i
    return runs


def _plot_timeline(ax: Any, points: list[tuple[Any, int, str, str]], label: str, scale: float, unit: str,
                   strip: tuple[float, float]) -> None:
    xs = [i / max(1, len(points) - 1) for i in range(len(points))]
    ys = [p[1] / scale for p in points]
    peak = max(range(len(ys)), key=ys.__getitem__)
    (line,) = ax.plot(xs, ys, linewidth=1.2,
                      label=f"{label}: peak {ys[peak]:.3g} {unit} in {points[peak][2]} ({points[peak][3]})")
    ax.plot([xs[peak]], [ys[peak]], marker="v", color=line.get_color())
    for first, last, phase in phase_runs(points):
        if phase in PHASE_COLORS:
            end = xs[min(last + 1, len(xs) - 1)]  # up to where the next phase starts
            ax.axvspan(xs[first], end, ymin=strip[0], ymax=strip[1], color=PHASE_COLORS[phase], linewidth=0)
            if last - first > len(points) // 8:
                ax.text((xs[first] + xs[last]) / 2, sum(strip) / 2, f"{label} {phase}", ha="center", va="center",
                        fontsize=7, color="#555555", transform=ax.get_xaxis_transform())
