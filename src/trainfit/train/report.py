"""What `trainfit train` prints at the end (rank 0 only): the run's summary, then its measured
step's memory per component against the predictions (the table `trainfit report` prints)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from trainfit.config import Config
from trainfit.memory import Comparison, MemoryBreakdown, comparison_table
from trainfit.models.params import format_count
from trainfit.parallel.layout import Layout
from trainfit.train.metrics import METRICS_FILE
from trainfit.train.trainer import TrainResult

MIB = 1024**2


def summary_rows(cfg: Config, result: TrainResult) -> list[tuple[str, str]]:
    rows = [
        ("model", f"{cfg.model.preset or 'custom'} ({cfg.model.hf_model_type or cfg.model.family}), "
                  f"{format_count(result.num_params)} params"),
        ("steps", f"{result.steps_done} / {cfg.training.steps}"
                  + (f" (resumed at step {result.started_at})" if result.started_at else "")),
        ("precision", f"{cfg.precision.mode}, activation checkpointing {cfg.memory.activation_checkpointing}"),
        ("parallel", layout_description(result.layout)),
    ]
    if result.losses:
        last_step = max(result.losses)
        rows.append(("train loss", f"{result.losses[last_step]:.4f} (step {last_step})"))
    if result.val_losses:
        first, last = min(result.val_losses), max(result.val_losses)
        shown = [f"{result.val_losses[step]:.4f} (step {step})" for step in sorted({first, last})]
        rows.append(("val loss", " -> ".join(shown)))
    if result.steps_run:
        rows.append(("throughput", throughput_text(result)))
    if result.compile_seconds:
        rows.append(("compile", f"{result.compile_seconds:,.1f} s (torch.compile: the steps that compiled, "
                                 "left out of the throughput)"))
    if result.memory is not None:
        per_rank = ", rank 0" if result.world_size > 1 else ""
        memory = result.memory
        rows.append(("peak memory", f"{memory.peak / MIB:,.1f} MiB of tensors (measured{per_rank}), "
                                    f"+ {memory.non_tensor / MIB:,.1f} MiB outside tensors during the step "
                                    f"+ {memory.reserved_margin / MIB:,.1f} MiB reserved margin (outside tensors "
                                    "before it: libraries, runtime); per component below"))
        if memory.reserved_peak is not None and memory.device_used is not None:  # CUDA only
            rows.append(("device memory", f"{memory.reserved_peak / MIB:,.1f} MiB reserved peak (caching allocator), "
                                          f"{memory.device_used / MIB:,.1f} MiB used on the device at the step's end "
                                          "(CUDA context, NCCL buffers, other processes included)"))
    if result.state_bytes is not None:
        states = ", ".join(f"{name} {n / MIB:,.1f}" for name, n in result.state_bytes.items())
        rows.append(("model states", f"{states} MiB (this rank's tensors)"))
    if cfg.precision.mode == "fp16-mixed":
        rows.append(("skipped steps", f"{result.skipped_steps} (inf/nan gradients under loss scaling)"))
    if result.checkpoint is not None:
        rows.append(("checkpoint", str(result.checkpoint)))
    rows.append(("metrics", f"{cfg.logging.dir}/{METRICS_FILE}"))
    return rows


def layout_description(layout: Layout) -> str:
    """E.g. "2 processes: ZeRO-3 (FSDP2) over dp_shard=2, offload optimizer", "4 processes: ZeRO-3
    (FSDP2) over dp_shard=1 x cp=2, tensor parallel tp=2 + sequence parallel, context parallel cp=2",
    "2 processes: pipeline pp=2 (1f1b, 2 stages of 2-2 blocks, 4 micro-batches)", "4 processes: ZeRO-3 (FSDP2)
    over dp_shard=4, expert parallel ep=2 (experts FSDP-sharded over edp=2)"."""
    world_size = layout.world_size
    if world_size == 1 and layout.offload == "none":
        return "1 process"
    parts = []
    if layout.data_parallel != "none":
        names = {0: "DDP", 1: "ZeRO-1 (sharded master weights and optimizer)", 2: "ZeRO-2 (FSDP2)",
                 3: "ZeRO-3 (FSDP2)"}
        stage = names[layout.zero_stage]
        if layout.dp_replicate > 1:
            axes = f"dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard}"
        else:
            axes = f"dp_shard={layout.dp_shard}" if layout.zero_stage else f"dp={layout.dp}"
        if layout.cp > 1:  # the cp ranks shard the states / average the gradients too
            axes += f" x cp={layout.cp}"
        if layout.zero_stage >= 1 and layout.dp_replicate > 1:
            stage = f"HSDP, {stage}"
        offload = f", offload {layout.offload}" if layout.offload != "none" else ""
        parts.append(f"{stage} over {axes}{offload}")
    if layout.tp > 1:
        parts.append(f"tensor parallel tp={layout.tp}" + (" + sequence parallel" if layout.sequence_parallel else ""))
    if layout.cp > 1:
        parts.append(f"context parallel cp={layout.cp}")
    if layout.pp > 1:
        split = "-".join(str(n) for n in layout.pp_layers)
        parts.append(f"pipeline pp={layout.pp} ({layout.pp_schedule}, {layout.num_stages} stages of {split} blocks, "
                     f"{layout.num_microbatches} micro-batches)")
    if layout.ep > 1:
        parts.append(f"expert parallel ep={layout.ep} (experts FSDP-sharded over edp="
                     f"{layout.dp_shard * layout.cp // layout.ep})")
    return f"{world_size} process{'es' if world_size > 1 else ''}: {', '.join(parts)}"


def print_summary(cfg: Config, result: TrainResult, console: Console | None = None,
                  predicted: dict[str, MemoryBreakdown] | None = None) -> None:
    """`predicted`: estimates by source name ("analytic", "traced"), compared with the last measured step."""
    from trainfit.tables import print_table
    if result.rank != 0:
        return
    console = console or Console()
    if result.stopped_by_signal:
        title = f"trainfit: stopped by {result.signal_name or 'a signal'} (rerun the same command to resume)"
    elif not result.steps_run:
        print(f"trainfit: nothing to do, the run was already complete at step {result.steps_done} "
              f"(training.steps={cfg.training.steps}, checkpoint {result.checkpoint}); raise training.steps "
              "to train on, or set a new checkpoint.dir to start another run")
        return
    else:
        title = "trainfit: run complete"
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(cfg, result):
        table.add_row(key, value)
    print_table(table, console)
    if result.memory is not None:
        print_table(comparison_table(Comparison({**(predicted or {}), "measured": result.memory})), console)


def throughput_text(result: TrainResult) -> str:
    """Tokens/s and MFU, or why either is missing."""
    if result.tokens_per_s is None:
        return ("not measured: every step was a warm-up, memory-measured or profiled step; run more steps "
                "(training.steps) to time some")
    speed = f"{result.tokens_per_s:,.0f} tokens/s"
    if result.mfu is None:
        return f"{speed} ({result.mfu_note or 'MFU not computed: no peak FLOP/s for this device'})"
    return f"{speed}, MFU {result.mfu:.1%}" + (f" ({result.mfu_note})" if result.mfu_note else "")
