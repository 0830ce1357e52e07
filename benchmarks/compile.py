"""Eager vs torch.compile'd blocks (training.compile) on this machine: tokens/s without the
compiling step, the compile time apart, and the peak measured at the allocator (the tensors' peak
+ non_tensor: what a compiled block allocates inside is no tensor the memory meter sees) against both
estimators, which model the eager step (traced.py traces it; memory/closed_form/analytic.py counts
eager's saved tensors), so a compiled row's estimate gaps are what fusion saves.

Inductor's partitioner (torch/_functorch/partitioners.py, min_cut_rematerialization_partition)
saves, of a compiled block's forward, the min-cut of what backward needs, recomputing cheap
pointwise ops (RMSNorm's scaling, RoPE's rotation, SiLU and its product) from fewer saved tensors,
and its fused backward frees temporaries eager keeps between separate kernels. Which tensors are
cut depends on the graph and inductor's heuristics (fusibility, a recompute cost model), which the
estimators do not model.

fp8-mixed: the analytic estimate prices a compiled step's casts to fp8 fused (memory/closed_form/analytic.py,
FLOAT8_CAST_BYTES_COMPILED) and its other tensors as eager's; the traced one traces the eager step.

    PYTHONPATH=src python benchmarks/compile.py [--steps 8] [--quick] [--precision MODE ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch._dynamo
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _analytic import memory_of  # noqa: E402
from _runs import run_config  # noqa: E402
from trainfit.traced import trace_step  # noqa: E402
from trainfit.train.trainer import Trainer  # noqa: E402

MiB = 2**20
SHAPE = ("--model.preset=debug", "--model.ffn_dim=384", "--model.dim=128", "--model.vocab_size=512",
         "--model.max_seq_len=256", "--training.seq_len=256", "--training.micro_batch_size=4",
         "--training.global_batch_size=4")
"""tests/estimator/accuracy_grid.py's LLAMA row: 2 blocks, GQA, SwiGLU."""
PRECISIONS = ("fp32", "bf16-mixed", "fp8-mixed")
CONFIGS = [(ac, precision) for precision in PRECISIONS for ac in ("none", "selective", "full")]


def run(ac: str, precision: str, compiled: bool, steps: int) -> dict[str, float]:
    overrides = (*SHAPE, f"--memory.activation_checkpointing={ac}", f"--precision.mode={precision}",
                 f"--training.compile={str(compiled).lower()}", f"--training.steps={steps}",
                 f"--logging.interval={steps}")
    cfg = run_config(Path(tempfile.mkdtemp()), *overrides)
    torch._dynamo.reset()
    result = Trainer(cfg).train()
    assert result.memory is not None
    allocator_peak = result.memory.peak + result.memory.non_tensor
    return {"tokens_per_s": result.tokens_per_s, "compile": result.compile_seconds, "peak": allocator_peak,
            "activations": result.memory.activations, "traced": trace_step(cfg).per_stage[0].peak,
            "analytic": memory_of(cfg).worst.peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (the first compiles, the 2nd is measured)")
    parser.add_argument("--quick", action="store_true", help="fp32 only")
    parser.add_argument("--precision", nargs="*", choices=PRECISIONS, default=PRECISIONS, help="these modes only")
    args = parser.parse_args()
    table = Table(title="training.compile: eager vs compiled blocks (1 process, CPU)")
    for column in ("AC", "precision", "blocks", "tokens/s", "compile s", "peak MiB", "vs eager", "traced",
                   "analytic"):
        table.add_column(column, justify="right")
    for ac, precision in CONFIGS[:3] if args.quick else [c for c in CONFIGS if c[1] in args.precision]:
        eager = run(ac, precision, False, args.steps)
        for compiled, row in ((False, eager), (True, run(ac, precision, True, args.steps))):
            table.add_row(ac, precision, "compiled" if compiled else "eager", f"{row['tokens_per_s']:,.0f}",
                          f"{row['compile']:.1f}" if compiled else "-", f"{row['peak'] / MiB:.2f}",
                          f"{row['peak'] / eager['peak'] - 1:+.1%}",
                          f"{row['traced'] / MiB:.2f} ({row['traced'] / row['peak'] - 1:+.1%})",
                          f"{row['analytic'] / MiB:.2f} ({row['analytic'] / row['peak'] - 1:+.1%})")
    Console(width=None if sys.stdout.isatty() else 160).print(table)


if __name__ == "__main__":
    main()
