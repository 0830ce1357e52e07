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

from trainfit.memory.breakdown import COMPONENTS, MemoryBreakdown
from trainfit.memory.report import GIB, fmt_bytes, pyplot, save_figure, stack_bars

PHASE_COLORS = {"forward": "#E8F1FA", "backward": "#FCEFE3", "optimizer": "#EAF5EA"}
SMALL_SHARE = 0.01
"""Components under this share of the reference peak get no error in percent."""


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
    return table


def plot_comparison(cmp: Comparison, path: str | Path) -> Path:
    """(a) the step's memory timeline with phases shaded and the peak marked; (b) stacked breakdowns."""
    plt = pyplot()
    fig, (ax_time, ax_bars) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    peak = max(b.peak for b in cmp.sources.values())
    unit, scale = ("GiB", GIB) if peak >= GIB else ("MiB", 1024**2)
    for i, (source, points) in enumerate(cmp.timelines.items()):
        _plot_timeline(ax_time, points, source, scale, unit, shade=i == 0)
    ax_time.set_xlabel("progress through one training step (operators, normalised)")
    ax_time.set_ylabel(f"{unit} in use")
    ax_time.set_title("memory over one step")
    ax_time.legend(loc="upper right", fontsize=8)
    names = list(cmp.sources)
    stack_bars(ax_bars, names, [cmp.sources[n] for n in names], COMPONENTS, scale)
    ax_bars.set_ylabel(f"{unit} at the peak")
    ax_bars.set_title("breakdown at the peak")
    ax_bars.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    return save_figure(fig, path)


def _plot_timeline(ax: Any, points: list[tuple[Any, int, str, str]], label: str, scale: float, unit: str,
                   shade: bool) -> None:
    if not points:
        return
    xs = [i / max(1, len(points) - 1) for i in range(len(points))]
    ys = [p[1] / scale for p in points]
    start = 0
    for i in range(1, len(points) + 1):  # shade each run of one phase, once per figure
        if i == len(points) or points[i][2] != points[start][2]:
            phase = points[start][2]
            if shade and phase in PHASE_COLORS and i - start > len(points) // 50:
                ax.axvspan(xs[start], xs[i - 1], color=PHASE_COLORS[phase], alpha=0.6, linewidth=0)
                ax.text((xs[start] + xs[i - 1]) / 2, 0.02, phase, ha="center", va="bottom", fontsize=8,
                        color="#555555", transform=ax.get_xaxis_transform())
            start = i
    ax.plot(xs, ys, label=label, linewidth=1.2)
    peak = max(range(len(ys)), key=ys.__getitem__)
    ax.plot([xs[peak]], [ys[peak]], marker="v", color="red")
    ax.annotate(f"{label} peak {ys[peak]:.3g} {unit} ({points[peak][2]}, {points[peak][3]})", (xs[peak], ys[peak]),
                fontsize=8, textcoords="offset points", xytext=(6, 4))
