"""Accuracy of the traced and analytic memory estimators against measured training steps, on CPU.

Runs the grid of tests/estimator/accuracy_grid.py (1, 2 and 4 gloo ranks; precision, optimizer,
activation checkpointing, ZeRO stage, HSDP, batch shape, dense and MoE models, MoE held to
asymmetric peak bounds; pipeline schedules, one line per stage against the stage's first rank):
each configuration is measured (rank 0's figures; every world size is one start of ranks),
traced, and estimated. Prints the peaks and their errors against the measured one (the tensors'
peak), the measured non_tensor bytes beside it (the allocator's peak above the tensors'); the
analytic estimate's worst component against the traced one, by the test's criterion (the largest
difference relative to its allowance, max(10% of the traced component, 1% of the traced peak)),
as % of the component (only for components of at least a tenth of the peak:
smaller ones are held to the peak) and of the peak; the analytic forward-retained bytes and model
states against the measured ones; the peak phases; then the median and worst errors, and the
analytic estimator's speed on llama3.1-405b over 16,384 GPUs. Progress goes to stderr: the whole
grid takes a few minutes.

    python benchmarks/estimator_accuracy.py [--only SUBSTRING ...] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "estimator")]  # accuracy_grid and the _runs it imports

from accuracy_grid import (  # noqa: E402
    ANALYTIC_TOLERANCE,
    COMPONENT_FLOOR,
    COMPONENT_TOLERANCE,
    GRID,
    PIPELINE_COMPONENT_FLOOR,
    PIPELINE_GRID,
    TRACED_PEAK_TOLERANCE,
    Analytic,
    Measured,
    MiB,
    Row,
    analytic,
    component_gaps,
    measure_rows,
    peak_bounds,
    trace,
)

from trainfit.config import write_atomic  # noqa: E402
from trainfit.configure import load_config  # noqa: E402
from trainfit.memory import MemoryBreakdown  # noqa: E402
from trainfit.memory.closed_form import estimate_memory  # noqa: E402
from trainfit.parallel.resolve import build_layout  # noqa: E402

COLUMNS = {  # key: (header, right-aligned)
    "config": ("configuration", False), "ranks": ("ranks", True), "measured": ("measured", True),
    "non_tensor": ("non\ntensor", True),
    "traced": ("traced", True), "traced error": ("error", True), "analytic": ("analytic", True),
    "analytic error": ("error", True), "component": ("worst component\nanalytic vs traced", False),
    "of component": ("of\ncomponent", True), "of peak": ("of\npeak", True),
    "retained error": ("forward\nretained\nerror", True), "states error": ("model\nstates\nerror", True),
    "phase": ("peak phase\nm/t/a", False),
}
ERRORS = ("traced error", "analytic error", "of component", "of peak", "retained error", "states error")
"""The columns that get a median and a worst row."""
TOLERANCES = {"traced error": TRACED_PEAK_TOLERANCE, "analytic error": ANALYTIC_TOLERANCE,
              "retained error": ANALYTIC_TOLERANCE, "states error": ANALYTIC_TOLERANCE}
PHASE = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}


RECORD = Path(__file__).with_name("estimator_accuracy.json")
"""The last whole grid's errors (`--record`), from which the documentation's accuracy page is drawn."""


def recorded(rows: dict[str, dict[str, float]]) -> dict:
    """The record of a grid run: every row's errors, the machine and the versions it ran on."""
    import datetime
    import platform

    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"recorded": datetime.date.today().isoformat(), "machine": f"{cpu}, {os.cpu_count()} cores",
            "torch": torch.__version__, "rows": rows}


def markdown(record: dict) -> str:
    """The record's median and worst errors of the traced and analytic peaks against the measured one."""
    lines = ["| estimate of the peak | rows | median abs error | worst error |", "| --- | ---: | ---: | ---: |"]
    for name, label in (("traced error", "traced"), ("analytic error", "analytic")):
        values = [errors[name] for errors in record["rows"].values() if name in errors]
        worst = max(values, key=abs)
        lines.append(f"| {label} | {len(values)} | {statistics.median(abs(v) for v in values):.1%} | {worst:+.1%} |")
    return "\n".join(lines) + (f"\n\nThe whole grid, {len(record['rows'])} rows (a pipeline stage a row), run on "
                               f"{record['recorded']} on {record['machine']}, torch {record['torch']}.\n")


def speed_ms(runs: int = 500) -> float:
    cfg = load_config(None, [
        "--model.preset=llama3.1-405b", "--hardware.num_gpus=16384", "--hardware.gpu=H100-SXM-80GB",
        "--parallel.tp=8", "--parallel.sequence_parallel=true", "--parallel.cp=2", "--parallel.pp=2",
        "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=7", "--parallel.zero_stage=3",
        "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
        "--training.global_batch_size=2048", "--memory.activation_checkpointing=full"])
    args = (cfg.model, build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer)
    estimate_memory(*args)
    start = time.perf_counter()
    for _ in range(runs):
        estimate_memory(*args)
    return (time.perf_counter() - start) / runs * 1e3


def _percent(x: float, tolerance: float | tuple[float, float] | None = None) -> str:
    """Coloured against `tolerance` (symmetric, or (low, high) bounds) when given; nan (a component
    under a tenth of the peak, held to 1% of the peak instead) as "-"."""
    if math.isnan(x):
        return "-"
    if tolerance is None:
        return f"{x:+.1%}"
    low, high = tolerance if isinstance(tolerance, tuple) else (-tolerance, tolerance)
    style = "green" if low / 2 <= x <= high / 2 else "yellow" if low <= x <= high else "red"
    return f"[{style}]{x:+.1%}[/{style}]"


def _stage_errors(row: Row, stage: int, measured: Measured, traced: MemoryBreakdown, estimate: Analytic
                  ) -> tuple[dict[str, float], dict[str, str]]:
    """A pipeline stage's errors (ERRORS) and its other cells, against the stage's first rank (pp is
    the mesh's outermost axis); without pipeline parallelism, stage 0 and rank 0."""
    first = measured.ranks[stage * row.world // len(estimate.per_stage)]
    measured_peak, ours = first.breakdown, estimate.per_stage[stage]
    gaps = component_gaps(ours, traced, PIPELINE_COMPONENT_FLOOR if row in PIPELINE_GRID else COMPONENT_FLOOR)
    worst = max(gaps, key=lambda name: abs(gaps[name][0]) / gaps[name][1])
    gap, allowed = gaps[worst]
    component = getattr(traced, worst)
    large = COMPONENT_TOLERANCE * component >= COMPONENT_FLOOR * traced.peak  # else shown against the peak
    pipelined = len(estimate.per_stage) > 1
    errors = {
        "traced error": traced.peak / measured_peak.peak - 1, "analytic error": ours.peak / measured_peak.peak - 1,
        "of component": gap / component if large else math.nan, "of peak": gap / traced.peak,
        # a pipeline's first forward is not followed by its own backward: no forward-retained figure
        "retained error": math.nan if pipelined else estimate.forward_retained / first.forward_retained - 1,
        "states error": estimate.model_states[stage] / sum(first.state_bytes.values()) - 1,
    }
    style = "green" if abs(gap) <= allowed else "red"
    cells = {"config": row.name + (f" stage {stage}" if pipelined else ""), "ranks": str(row.world),
             "measured": f"{measured_peak.peak / MiB:.2f}", "non_tensor": f"{measured_peak.non_tensor / MiB:.2f}",
             "traced": f"{traced.peak / MiB:.2f}",
             "analytic": f"{ours.peak / MiB:.2f}", "component": f"[{style}]{worst} {gap / MiB:+.2f}[/{style}]",
             "phase": "/".join(PHASE[b.peak_phase] for b in (measured_peak, traced, ours))}
    return errors, cells


def _table(rows: list[Row], tmp: Path, measured: dict[str, Measured], record: dict[str, dict[str, float]] | None = None
           ) -> Table:
    table = Table(title="memory estimators vs a measured CPU step (MiB; rank 0, and under pipeline parallelism each "
                        "stage's first rank; measured = the tensors' peak, non tensor = the allocator's peak above "
                        "it; error = estimate / measured - 1)")
    for header, right in COLUMNS.values():
        table.add_column(header, justify="right" if right else "left")
    columns: dict[str, list[float]] = {name: [] for name in ERRORS}
    for row in rows:
        print(f"tracing and estimating {row.name}", file=sys.stderr, flush=True)
        traced, estimate = trace(row, tmp), analytic(row, tmp)
        for stage, stage_traced in enumerate(traced):
            errors, cells = _stage_errors(row, stage, measured[row.name], stage_traced, estimate)
            traced_bounds, analytic_bounds = peak_bounds(row)  # MoE rows: asymmetric
            bounds = {"traced error": traced_bounds, "analytic error": analytic_bounds}
            if record is not None:
                record[cells["config"] + f" ({row.world} ranks)"] = {
                    name: round(value, 5) for name, value in errors.items() if not math.isnan(value)}
            for name, value in errors.items():
                columns[name].append(value)
                cells[name] = _percent(value, bounds.get(name, TOLERANCES.get(name)))
            table.add_row(*(cells[key] for key in COLUMNS))
    table.add_section()
    picks: dict[str, Callable[[list[float]], float]] = {
        "median |error|": lambda e: statistics.median(abs(x) for x in e),
        "worst error": lambda e: max(e, key=abs),
    }
    for label, pick in picks.items():
        known = {name: [x for x in values if not math.isnan(x)] for name, values in columns.items()}
        summary = {name: _percent(pick(values)) if values else "-" for name, values in known.items()}
        table.add_row(*(label if key == "config" else summary.get(key, "") for key in COLUMNS))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="run the configurations whose name contains one")
    parser.add_argument("--ranks", nargs="*", type=int, default=[1, 2, 4], help="run these world sizes")
    parser.add_argument("--record", metavar="FILE.json", help=f"write every row's errors there (the whole grid: "
                        f"{RECORD.name} beside this script, which --markdown summarises)")
    parser.add_argument("--markdown", action="store_true", help=f"print {RECORD.name}'s summary as Markdown and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(RECORD.read_text())))
        return
    rows = [row for row in GRID if row.world in args.ranks and (not args.only or any(s in row.name for s in args.only))]
    console = Console(width=None if sys.stdout.isatty() else 200)  # piped: the whole table, unwrapped
    if not rows:
        console.print("no configuration matched --only / --ranks")
        return
    start = time.perf_counter()
    record: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = _table(rows, Path(tmp), measure_rows(rows, Path(tmp), progress=True), record)
    console.print(table)
    if args.record:
        write_atomic(args.record, json.dumps(recorded(record), indent=1) + "\n")
        console.print(f"wrote {args.record}")
    console.print(f"{len(rows)} configurations measured, traced and estimated in {time.perf_counter() - start:.0f} s; "
                  f"one analytic estimate of llama3.1-405b on 16,384 GPUs (tp 8, cp 2, pp 2 x 7 virtual, "
                  f"ZeRO-3 over 512): {speed_ms():.3f} ms")


if __name__ == "__main__":
    main()
