"""An Estimate as people read it: tables (rich) and the stacked-bar picture (matplotlib).

Bytes are ints everywhere else; units appear only when printed (trainfit.units).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainfit.estimate import Estimate, advice
from trainfit.figures import pyplot, save_figure, stack_bars
from trainfit.memory import COMPONENTS
from trainfit.models.params import format_count, param_counts
from trainfit.units import GIB, fmt_bytes, fmt_seconds

if TYPE_CHECKING:  # rich only where a table is drawn
    from rich.console import Console
    from rich.table import Table

    from trainfit.parallel.resolve import GlobalBatch

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
    if t.get("nf4_dequant_s"):
        table.add_row("  NF4 dequantization (in compute)", fmt_seconds(t["nf4_dequant_s"]))
    parts = t.get("compute_parts_s") or {}
    for kind, label in (("matmul", "matmuls"), ("attention", "attention"), ("elementwise", "elementwise traffic")):
        if kind in parts:
            table.add_row(f"  {label}", fmt_seconds(parts[kind]))
    if parts.get("launches", 0) > sum(v for k, v in parts.items() if k != "launches"):
        table.add_row("  kernel launches (host; set the pace)", fmt_seconds(parts["launches"]))
    for kind, seconds in t["comm_s"].items():
        if seconds:
            table.add_row(f"  {kind} (total)", fmt_seconds(seconds))
    table.add_row("exposed communication", fmt_seconds(t["exposed_comm_s"]))
    table.add_row("pipeline bubble", fmt_seconds(t["bubble_s"]))
    if t["exposed_host_s"]:
        table.add_row("host work beyond the device (dispatch, DTensor, FSDP2)", fmt_seconds(t["exposed_host_s"]))
    table.add_row("step time", fmt_seconds(t["step_time_s"]), style="bold")
    table.add_row("tokens / s (whole job)", f"{t['tokens_per_second']:,.0f}")
    table.add_row("MFU", f"{t['mfu']:.1%}")
    return table


def print_estimate(est: Estimate, console: Console | None = None, fixes: Sequence[Any] = (),
                   fixes_batch: GlobalBatch | None = None, methods: Sequence[Any] = ()) -> None:
    """The estimate's tables; when it does not fit, `fixes` (plan/fixes.Fix: the fewest changes that
    fit) and the global batch they keep (`fixes_batch`), or failing those the single changes that
    save the most."""
    from rich.console import Console

    from trainfit.tables import print_table

    console = console or Console()
    cfg, d = est.cfg, est.layout
    counts = param_counts(cfg.model)
    active = f", {format_count(counts.active)} active" if counts.active != counts.total else ""
    console.print(f"[bold]{cfg.model.preset or 'custom'}[/bold] ({cfg.model.hf_model_type or cfg.model.family}): "
                  f"{format_count(counts.total)} params{active} on {d.world_size} x {cfg.hardware.gpu} | "
                  f"dp {d.dp_replicate}x{d.dp_shard} (ZeRO-{d.zero_stage}) tp {d.tp} pp {d.pp} cp {d.cp} "
                  f"ep {d.ep} | {cfg.precision.mode}, {cfg.optimizer.name}, AC {cfg.memory.activation_checkpointing}"
                  f" | micro-batch {cfg.training.micro_batch_size} x {cfg.training.seq_len} tokens, "
                  f"{d.grad_accum_steps} accumulation steps")
    console.print(est.attention_note())
    for note in (est.fp8_note(), est.peft_note()):
        if note:
            console.print(note)
    print_table(_memory_table(est), console)
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
                console.print(f"  - {' '.join(fix.overrides)}: {fmt_bytes(c.memory_bytes)} per GPU, "
                              f"{c.tokens_per_second:,.0f} tokens/s, MFU {c.mfu:.1%}", soft_wrap=True)
        else:
            for line in advice(est):
                console.print(f"  - {line}")
        if methods:  # plan/fixes.method_changes: fine-tuning adapters instead of every weight
            console.print("faster, by a change of method (training adapters instead of every weight):")
        for fix in methods:
            c = fix.candidate
            console.print(f"  - {fix.note}: {' '.join(fix.overrides)}: {fmt_bytes(c.memory_bytes)} per GPU, "
                          f"{c.tokens_per_second:,.0f} tokens/s, MFU {c.mfu:.1%}", soft_wrap=True)
    print_table(_perf_table(est), console)


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
