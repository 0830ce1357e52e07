"""Accuracy of the analytic memory estimator against measured training steps, on CPU.

Runs the grid of tests/estimator/_measure.py (precision x optimizer x activation checkpointing x
micro-batch x sequence length x model shape): for each configuration, trainfit's Trainer warms
up one step, then one step is measured at the allocator (glibc in-use bytes after every aten
operator). Prints measured vs analytic activations (after forward + loss), model states and
peak, with the error of each, then the median and worst errors, and the analytic estimator's
speed on llama3-405b over 16,384 GPUs.

    python benchmarks/estimator_accuracy.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "estimator"))

from _measure import GRID, config, grid_name, grid_overrides, measure_step  # noqa: E402

from trainfit.config import load_config  # noqa: E402
from trainfit.memory.analytic import estimate_memory, forward_retained_bytes, model_states  # noqa: E402

MIB = 2**20
COMPONENTS = ("activations", "model states", "peak")


def speed_ms(runs: int = 500) -> float:
    cfg = load_config(None, [
        "--model.preset=llama3-405b", "--hardware.num_gpus=16384", "--hardware.gpu=H100-SXM-80GB",
        "--parallel.tp=8", "--parallel.sequence_parallel=true", "--parallel.cp=2", "--parallel.pp=2",
        "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_virtual_stages=7", "--parallel.zero_stage=3",
        "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
        "--training.global_batch_size=2048", "--memory.activation_checkpointing=full"])
    estimate_memory(cfg)
    start = time.perf_counter()
    for _ in range(runs):
        estimate_memory(cfg)
    return (time.perf_counter() - start) / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="run the configurations whose name contains one")
    args = parser.parse_args()
    console = Console()
    table = Table(title="analytic memory vs a measured CPU step (MiB; error = analytic / measured - 1)")
    table.add_column("configuration")
    for name in COMPONENTS:
        table.add_column(f"{name}\nmeasured", justify="right")
        table.add_column("analytic", justify="right")
        table.add_column("error", justify="right")
    table.add_column("peak phase\nmeas. / anal.")
    errors: dict[str, list[float]] = {name: [] for name in COMPONENTS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for row in GRID:
            name = grid_name(row)
            if args.only and not any(part in name for part in args.only):
                continue
            cfg = config(Path(tmp), *grid_overrides(row))
            measured = measure_step(cfg)
            estimate = estimate_memory(cfg).worst
            pairs = {
                "activations": (measured.activations, forward_retained_bytes(cfg)),
                "model states": (measured.model_states, model_states(cfg).model_states),
                "peak": (measured.peak, estimate.peak),
            }
            cells = []
            for component, (real, predicted) in pairs.items():
                error = predicted / real - 1
                errors[component].append(error)
                style = "green" if abs(error) <= 0.05 else "yellow" if abs(error) <= 0.10 else "red"
                cells += [f"{real / MIB:.2f}", f"{predicted / MIB:.2f}", f"[{style}]{error:+.1%}[/{style}]"]
            measured_phase = max(measured.phase_peaks, key=measured.phase_peaks.get)
            table.add_row(name, *cells, f"{measured_phase} / {estimate.peak_phase}")
    if not errors["peak"]:
        console.print("no configuration matched --only")
        return
    table.add_section()
    for label, pick in (("median |error|", lambda e: statistics.median(abs(x) for x in e)),
                        ("worst error", lambda e: max(e, key=abs))):
        row = [label]
        for component in COMPONENTS:
            row += ["", "", f"{pick(errors[component]):+.1%}"]
        table.add_row(*row, "")
    console.print(table)
    console.print(f"{len(errors['peak'])} configurations measured in {time.perf_counter() - start:.0f} s; "
                  f"one analytic estimate of llama3-405b on 16,384 GPUs (tp 8, cp 2, pp 2 x 7 virtual, "
                  f"ZeRO-3 over 512): {speed_ms():.3f} ms")


if __name__ == "__main__":
    main()
