"""Full fine-tuning against LoRA, DoRA and QLoRA on this machine's CPU: tokens/s of the same model and batch,
its first steps left out, beside the time model's prediction of the ratio (perf/flops.py: a frozen
base computes no weight gradients; QLoRA's dequantizations are memory traffic) and the measured peak.

    PYTHONPATH=src python benchmarks/peft_speed.py [--steps 12] [--preset tiny] [--ranks 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _runs import run_config  # noqa: E402
from trainfit.estimate import estimate  # noqa: E402
from trainfit.train.trainer import Trainer  # noqa: E402

MiB = 2**20
WARM_STEPS = 3
"""Steps left out of the rate: the first allocates, the meter's measured steps run slower."""


def run(args: list[str], steps: int, root: Path) -> tuple[float, float, float]:
    """(tokens/s of the last logged window of plain steps, the time model's tokens/s, the measured
    peak in MiB: the memory meter's step)."""
    cfg = run_config(root, *args, f"--training.steps={steps}", "--logging.traced_estimate=false",
                     f"--logging.interval={steps - WARM_STEPS}")
    result = Trainer(cfg).train()
    assert result.tokens_per_s is not None and result.memory is not None
    return result.tokens_per_s, estimate(cfg).perf.time["tokens_per_second"], result.memory.peak / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ranks", type=int, default=16, help="LoRA/DoRA rank")
    args = parser.parse_args()
    base = [f"--model.preset={args.preset}", "--training.seq_len=128", "--training.micro_batch_size=8",
            "--training.global_batch_size=8"]
    rows = [("full fine-tuning", []),
            ("LoRA q, v", ["--peft.method=lora", f"--peft.rank={args.ranks}"]),
            ("LoRA all-linear", ["--peft.method=lora", "--peft.targets=all-linear", f"--peft.rank={args.ranks}"]),
            ("DoRA all-linear", ["--peft.method=dora", "--peft.targets=all-linear", f"--peft.rank={args.ranks}"]),
            ("QLoRA q, v", ["--peft.method=qlora", f"--peft.rank={args.ranks}"]),
            ("QLoRA all-linear", ["--peft.method=qlora", "--peft.targets=all-linear", f"--peft.rank={args.ranks}"])]
    table = Table(title=f"{args.preset}: tokens/s on this CPU, full fine-tuning against adapters (the last "
                        f"{args.steps - WARM_STEPS} of {args.steps} steps)")
    for header in ("method", "tokens/s", "x full", "predicted x full", "measured peak MiB"):
        table.add_column(header, justify="left" if header == "method" else "right")
    full = predicted_full = None
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(rows):
            rate, predicted, peak = run([*base, *extra], args.steps, Path(tmp) / str(i))
            full, predicted_full = full or rate, predicted_full or predicted
            table.add_row(name, f"{rate:,.0f}", f"{rate / full:.2f}", f"{predicted / predicted_full:.2f}",
                          f"{peak:.1f}")
    Console().print(table)


if __name__ == "__main__":
    main()
