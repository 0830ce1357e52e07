"""`trainfit report --profile`: the per-rank summary of profiled steps as tables (rich) and as a
timeline picture (matplotlib), from perf/trace.py's RankProfiles."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from trainfit.figures import pyplot, save_figure
from trainfit.perf.trace import RankProfile, subtract
from trainfit.units import fmt_bytes

TOP_OPERATORS = 10
COLORS = {"compute": "#4C72B0", "communication": "#DD8452", "exposed": "#C44E52"}
LABELS = {"compute": "compute", "communication": "communication (hidden by compute)",
          "exposed": "exposed communication"}


def _share(us: float, wall_us: float) -> str:
    return f"{us / 1e3:,.1f} {us / wall_us:4.0%}" if wall_us else "0"


def _steps(profile: RankProfile) -> str:
    steps = profile.steps
    if not steps:
        return "whole trace"
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def _shorten(name: str, width: int = 32) -> str:
    """Long names cut in the middle: their ends tell apart forward and backward kernels."""
    return name if len(name) <= width else name[:width // 2 - 1] + "…" + name[-(width - width // 2):]


def time_table(profiles: list[RankProfile]) -> Table:
    """One row per rank: where its profiled steps' wall time went."""
    first = profiles[0]
    title = (f"profiled step(s) {_steps(first)} per rank, ms ({first.device}; compute + exposed comm + idle = wall; "
             "comm may overlap compute)")
    table = Table(title=title)
    for name in ("rank", "wall", "compute", "comm", "exposed\ncomm", "idle", "memory\n+peak"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in profiles:
        memory = fmt_bytes(p.memory_growth_bytes) if p.memory_growth_bytes is not None else "-"
        table.add_row(str(p.rank), f"{p.wall_us / 1e3:,.1f}", _share(p.compute_us, p.wall_us),
                      _share(p.comm_us, p.wall_us), _share(p.exposed_comm_us, p.wall_us),
                      _share(p.idle_us, p.wall_us), memory)
    return table


def operator_table(profiles: list[RankProfile], top: int = TOP_OPERATORS) -> Table:
    """The operators with the most self time, averaged over the ranks, with the busiest rank's."""
    per_rank: dict[str, list[tuple[float, int, int]]] = {}  # name -> [(self us, calls, rank)]
    for p in profiles:
        for op in p.ops:
            per_rank.setdefault(op.name, []).append((op.self_us, op.calls, p.rank))
    n = len(profiles)
    ranked = sorted(per_rank.items(), key=lambda item: -sum(us for us, _, _ in item[1]))[:top]
    wall = sum(p.wall_us for p in profiles) / n
    kind = "kernels" if profiles[0].device == "cuda" else "operators"
    table = Table(title=f"top {len(ranked)} {kind} by self time (mean over {n} rank{'s' if n > 1 else ''})")
    table.add_column(kind[:-1], no_wrap=True)
    for name in ("calls", "self ms", "% of\nwall", *(["busiest\nrank: ms"] if n > 1 else [])):
        table.add_column(name, justify="right", no_wrap=True)
    for name, rows in ranked:
        mean = sum(us for us, _, _ in rows) / n
        busiest = max(rows)
        busiest_cell = [f"{busiest[2]}: {busiest[0] / 1e3:,.2f}"] if n > 1 else []
        table.add_row(_shorten(name), f"{sum(c for _, c, _ in rows) / n:g}", f"{mean / 1e3:,.2f}",
                      f"{mean / wall:.1%}" if wall else "-", *busiest_cell)
    return table


def plot_timeline(profiles: list[RankProfile], path: str | Path) -> Path:
    """One row per rank: compute below, communication above (red where no compute hides it); blank
    is idle. On one host the ranks share a time axis; across hosts each rank starts at 0."""
    plt = pyplot()
    shared = len({p.host for p in profiles}) == 1
    origin = min(p.windows[0][0] for p in profiles if p.windows) if shared else None
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(profiles)))
    for row, p in enumerate(profiles):
        if not p.windows:
            continue
        zero = origin if origin is not None else p.windows[0][0]
        lanes = [(p.compute, row - 0.36, "compute"), (p.comm, row + 0.04, "communication"),
                 (subtract(p.comm, p.compute), row + 0.04, "exposed")]
        for intervals, y, lane in lanes:
            ax.broken_barh([((s - zero) / 1e3, (e - s) / 1e3) for s, e in intervals], (y, 0.32), color=COLORS[lane],
                           label=LABELS[lane] if row == 0 else None, linewidth=0)
        for start, end in p.windows:
            ax.plot([(start - zero) / 1e3] * 2, [row - 0.45, row + 0.45], color="black", linewidth=0.8)
            ax.plot([(end - zero) / 1e3] * 2, [row - 0.45, row + 0.45], color="black", linewidth=0.8)
    ax.set_yticks(range(len(profiles)), [f"rank {p.rank}" for p in profiles])
    ax.set_ylim(len(profiles) - 0.5, -0.5)
    ax.set_xlabel("ms" + ("" if shared else " (each rank from its first step's start)"))
    ax.set_title(f"profiled step(s) {_steps(profiles[0])}: blank = idle; black lines = step boundaries")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return save_figure(fig, path)
