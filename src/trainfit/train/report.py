"""The summary printed at the end of `trainfit train`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from trainfit.config import Config
from trainfit.train.metrics import METRICS_FILE
from trainfit.train.trainer import TrainResult

MIB = 1024**2


def summary_rows(cfg: Config, result: TrainResult) -> list[tuple[str, str]]:
    rows = [
        ("model", f"{cfg.model.preset or 'custom'} ({cfg.model.family}), {result.num_params / 1e6:.2f}M params"),
        ("steps", f"{result.steps_done} / {cfg.training.steps}"),
        ("precision", f"{cfg.precision.mode}, activation checkpointing {cfg.memory.activation_checkpointing}"),
    ]
    if result.losses:
        last_step = max(result.losses)
        rows.append(("train loss", f"{result.losses[last_step]:.4f} (step {last_step})"))
    if result.val_losses:
        first, last = min(result.val_losses), max(result.val_losses)
        rows.append(("val loss", f"{result.val_losses[first]:.4f} (step {first}) -> "
                                 f"{result.val_losses[last]:.4f} (step {last})"))
    rows.append(("throughput", f"{result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.1%} "
                               f"(peak from hardware.gpu={cfg.hardware.gpu!r})"))
    if result.peak_memory_bytes is not None:
        rows.append(("peak memory", f"{result.peak_memory_bytes / MIB:,.1f} MiB (measured at the allocator)"))
    if cfg.precision.mode == "fp16-mixed":
        rows.append(("skipped steps", f"{result.skipped_steps} (inf/nan gradients under loss scaling)"))
    if result.checkpoint is not None:
        rows.append(("checkpoint", str(result.checkpoint)))
    rows.append(("metrics", f"{cfg.logging.dir}/{METRICS_FILE}"))
    return rows


def print_summary(cfg: Config, result: TrainResult, console: Console | None = None) -> None:
    console = console or Console()
    title = "trainfit: stopped by signal (rerun the same command to resume)" if result.stopped_by_signal \
        else "trainfit: run complete"
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(cfg, result):
        table.add_row(key, value)
    console.print(table)
