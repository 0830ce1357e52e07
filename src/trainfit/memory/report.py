"""Human-readable estimates: tables (rich) and the stacked-bar picture (matplotlib).

Bytes are ints everywhere else; units appear only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainfit.config import ConfigError
from trainfit.estimate import Estimate, advice
from trainfit.memory.breakdown import COMPONENTS, MemoryBreakdown
from trainfit.models.params import format_count, param_counts

if TYPE_CHECKING:  # rich only where a table is drawn (`plan --json` and fmt_bytes's users draw none)
    from rich.console import Console
    from rich.table import Table

    from trainfit.parallel.layout import GlobalBatch

GIB = 1024**3
MIB = 1024**2
COLORS = {"params": "#4C72B0", "master_params": "#8172B2", "grads": "#DD8452", "optimizer": "#C44E52",
          "activations": "#55A868", "logits": "#937860", "buffers": "#8C8C8C", "reserved_margin": "#DADADA",
          "non_tensor": "#E4D8B4"}


def fmt_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:,.2f} GiB"
    return f"{n / MIB:,.1f} MiB"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


MARGIN_LABELS = {"comm_buffers": "comm_buffers (NCCL)"}
"""Labels of reserved_margin's terms (MemoryBreakdown.margin_terms) where the name alone says too little."""

MAX_RANK_COLUMNS = 4
"""Pipeline ranks shown side by side; with more, the first, the worst and the last (--json has all)."""


def _shown_ranks(est: Estimate) -> list[int]:
    count, worst = len(est.memory.per_stage), est.memory.worst_stage
    return list(range(count)) if count <= MAX_RANK_COLUMNS else sorted({0, worst, count - 1})


def _memory_table(est: Estimate) -> Table:
    from rich.table import Table

    worst = est.worst
    count = len(est.memory.per_stage)
    shown = _shown_ranks(est)
    stages = [est.memory.per_stage[i] for i in shown]
    title = "memory per GPU"
    if count > 1:
        title += f" (worst: pp rank {est.memory.worst_stage}"
        title += ")" if len(shown) == count else f"; {len(shown)} of {count} pp ranks shown, all in --json)"
    table = Table(title=title)
    table.add_column("component")
    if count > 1:
        for i in shown:
            table.add_column(f"pp rank {i}", justify="right")
    else:
        table.add_column("bytes", justify="right")
        table.add_column("share of peak", justify="right")
    for name in (*COMPONENTS, "peak", "reserved_margin"):
        if count > 1:
            table.add_row(name, *(fmt_bytes(getattr(s, name)) for s in stages))
        else:
            value = getattr(worst, name)
            share = f"{value / worst.peak:.0%}" if worst.peak and name in COMPONENTS else ""
            table.add_row(name, fmt_bytes(value), share, style="bold" if name == "peak" else None)
    for term in worst.margin_terms:  # the margin's terms (GPUs), under it: they sum to it
        table.add_row(f"  {MARGIN_LABELS.get(term, term)}", *(fmt_bytes(s.margin_terms.get(term, 0)) for s in stages),
                      *([""] if count == 1 else []), style="dim")
    device = fmt_bytes(est.device_memory) if est.device_memory else "n/a (cpu)"
    table.add_row("device memory", *([device] * (len(stages) if count > 1 else 1)))
    return table


def _perf_table(est: Estimate) -> Table:
    from rich.table import Table

    t, f = est.perf.time, est.perf.flops
    table = Table(title="compute and time per step")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("model FLOPs / step", f"{f['model_flops_per_step']:.3e}")
    table.add_row("hardware FLOPs / step (with recompute)", f"{f['hardware_flops_per_step']:.3e}")
    table.add_row("compute", fmt_seconds(t["compute_s"]))
    if t["fp8_cast_s"]:
        table.add_row("  fp8 casts (in compute)", fmt_seconds(t["fp8_cast_s"]))
    for kind, seconds in t["comm_s"].items():
        if seconds:
            table.add_row(f"  {kind} (total)", fmt_seconds(seconds))
    table.add_row("exposed communication", fmt_seconds(t["exposed_comm_s"]))
    table.add_row("pipeline bubble", fmt_seconds(t["bubble_s"]))
    if t["exposed_host_s"]:
        table.add_row("framework host work (DTensor, FSDP2)", fmt_seconds(t["exposed_host_s"]))
    table.add_row("step time", fmt_seconds(t["step_time_s"]), style="bold")
    table.add_row("tokens / s (whole job)", f"{t['tokens_per_second']:,.0f}")
    table.add_row("MFU", f"{t['mfu']:.1%}")
    return table


def print_estimate(est: Estimate, console: Console | None = None, fixes: Sequence[Any] = (),
                   fixes_batch: GlobalBatch | None = None) -> None:
    """The estimate's tables; when it does not fit, `fixes` (plan/fixes.Fix: the fewest changes that
    fit) and the global batch they keep (`fixes_batch`), or failing those the single changes that
    save the most."""
    from rich.console import Console

    console = console or Console()
    cfg, d = est.cfg, est.layout
    counts = param_counts(cfg.model)
    active = f", {format_count(counts.active)} active" if counts.active != counts.total else ""
    console.print(f"[bold]{cfg.model.preset or 'custom'}[/bold] ({cfg.model.family}): "
                  f"{format_count(counts.total)} params{active} on {d.world_size} x {cfg.hardware.gpu} | "
                  f"dp {d.dp_replicate}x{d.dp_shard} (ZeRO-{d.zero_stage}) tp {d.tp} pp {d.pp} cp {d.cp} "
                  f"ep {d.ep} | {cfg.precision.mode}, {cfg.optimizer.name}, AC {cfg.memory.activation_checkpointing}"
                  f" | micro-batch {cfg.training.micro_batch_size} x {cfg.training.seq_len} tokens, "
                  f"{d.grad_accum_steps} accumulation steps")
    console.print(est.attention_note())
    fp8 = est.fp8_note()
    if fp8:
        console.print(fp8)
    console.print(_memory_table(est))
    worst = est.worst
    top = ", ".join(f"{name} {fmt_bytes(value)}" for name, value in worst.largest(3))
    console.print(f"peak in the [bold]{worst.peak_phase}[/bold] phase; largest: {top}")
    total = est.total_bytes(worst)
    if est.device_memory == 0:
        console.print(f"needs {fmt_bytes(total)} per rank (no device memory limit: cpu)")
    elif est.fits:
        console.print(f"[green]fits[/green]: {fmt_bytes(total)} of {fmt_bytes(est.device_memory)} "
                      f"({total / est.device_memory:.0%})")
    else:
        console.print(f"[red]does not fit[/red]: {fmt_bytes(total)} needed, {fmt_bytes(est.device_memory)} "
                      "available")
        if fixes_batch is not None:
            console.print(f"fixes keep the global batch of {fixes_batch.words()}" if fixes else
                          f"no layout among trainfit plan's options fits {cfg.hardware.num_gpus} x {cfg.hardware.gpu} "
                          f"with the global batch of {fixes_batch.words()}: add GPUs (hardware.num_gpus) or use a "
                          "device with more memory (hardware.gpu)")
        if fixes:
            console.print("the fewest changes that fit (trainfit plan's options; fewest first, then fastest):")
            for fix in fixes:
                c = fix.candidate
                console.print(f"  - {', '.join(fix.changes)}: {fmt_bytes(c.memory_bytes)} per GPU, "
                              f"{c.tokens_per_second:,.0f} tokens/s, MFU {c.mfu:.1%}")
        else:
            for line in advice(est):
                console.print(f"  - {line}")
    console.print(_perf_table(est))


def plot_breakdown(est: Estimate, path: str | Path) -> Path:
    """A stacked bar of the breakdown of each pipeline stage (one bar without pp), device memory dashed."""
    plt = pyplot()
    stages = est.memory.per_stage
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(stages) + 5), 5))
    labels = [f"stage {i}" for i in range(len(stages))] if len(stages) > 1 else ["per GPU"]
    stack_bars(ax, labels, stages, (*COMPONENTS, "reserved_margin"), GIB)
    if est.device_memory:
        ax.axhline(est.device_memory / GIB, color="black", linestyle="--", linewidth=1,
                   label=f"{est.cfg.hardware.gpu} memory")
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{est.cfg.model.preset or 'model'}: memory at the peak ({est.worst.peak_phase})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    return save_figure(fig, path)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or a clear error when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("--plot needs matplotlib: pip install 'trainfit[plot]'") from err
    return plt


def stack_bars(ax: Any, labels: list[str], breakdowns: Sequence[MemoryBreakdown], names: Sequence[str],
               scale: float) -> None:
    """One stacked bar per breakdown, one colour per component (components that are all zero skipped)."""
    bottoms = [0.0] * len(breakdowns)
    for name in names:
        heights = [getattr(b, name) / scale for b in breakdowns]
        if any(heights):
            ax.bar(labels, heights, bottom=bottoms, label=name, color=COLORS[name], width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]


FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")
"""What --plot can write (matplotlib's Agg, PDF, SVG and PS backends, with Pillow for jpg/webp/tif)."""


def check_figure_path(option: str, path: str | Path) -> None:
    """Fail before any work when a figure could not be written there."""
    out = Path(path)
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in FIGURE_FORMATS:
        raise ConfigError(f"{option} {str(path)!r}: " + (f"unknown image type .{suffix}" if suffix else "no extension")
                          + f"; end the name with one of .{', .'.join(FIGURE_FORMATS)} (e.g. memory.png)")
    parent = out.absolute().parent
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        raise ConfigError(f"{option} {str(path)!r}: the folder {str(parent)!r} {what}; create it or write elsewhere")


def save_figure(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
