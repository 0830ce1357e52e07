"""fp8-mixed against bf16-mixed on this machine: peak memory of one training step, measured at the
allocator (memory/measured/attribution.py) against the traced and analytic estimates, and training tokens/s.

This is a CPU: it has no fp8 units. torch._scaled_mm's CPU kernel computes fp8 operands its own way,
every float8 Linear adds its dynamic-scale casts (abs, amax, scale, clamp, convert: two casts per
matmul in forward, four in backward), and a CPU without bf16 matrix units runs bf16 matmuls slowly
too: the tokens/s ratio here says nothing about a GPU (and on a 2-core machine shared with other
jobs it is noisy; run it alone, and more than once). The memory figures are the point: what fp8
removes (autocast's bf16 weight copies) and adds (the casts' transients in each float8 backward) is
the same on any device; the estimators price both.

    python benchmarks/fp8.py [--steps 20] [--ffn-dim 1024] [--seq-len 256] [--micro-batch 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from techniques import tokens_per_s  # beside this script
from trainfit.config import Config
from trainfit.configure import load_config
from trainfit.memory.closed_form import estimate_memory
from trainfit.parallel.resolve import build_layout
from trainfit.traced import trace_step
from trainfit.train.trainer import measure_step

MiB = 2**20
VARIANTS = {"bf16-mixed": ("--precision.mode=bf16-mixed",),
            "fp8 tensorwise": ("--precision.mode=fp8-mixed", "--precision.fp8_scaling=tensorwise"),
            "fp8 rowwise": ("--precision.mode=fp8-mixed", "--precision.fp8_scaling=rowwise")}


def config(run_dir: Path, args: argparse.Namespace, precision: tuple[str, ...]) -> Config:
    """The accuracy grid's Llama shape (dims multiples of 16: every block linear in float8)."""
    return load_config(None, [
        "--model.preset=debug", "--model.dim=128", f"--model.ffn_dim={args.ffn_dim}", "--model.vocab_size=512",
        f"--model.max_seq_len={args.seq_len}", f"--training.seq_len={args.seq_len}",
        f"--training.micro_batch_size={args.micro_batch}", f"--training.global_batch_size={args.micro_batch}",
        "--training.device=cpu", "--training.eval_interval=0", "--checkpoint.interval=0",
        "--checkpoint.resume=never", f"--checkpoint.dir={run_dir / 'ckpt'}", f"--logging.dir={run_dir / 'logs'}",
        "--logging.progress=false", *precision])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ffn-dim", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    table = Table(title=f"bf16-mixed vs fp8-mixed on this CPU ({torch.get_num_threads()} threads; fp8 has no "
                        "hardware here: its speed is not a GPU's)")
    for column in ("precision", "measured MiB", "traced MiB", "traced err", "analytic MiB", "analytic err",
                   "tokens/s", "vs bf16"):
        table.add_column(column, justify="left" if column == "precision" else "right")
    baseline = None
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in VARIANTS.items():
            cfg = config(Path(tmp) / name.replace(" ", "-"), args, precision)
            measured = measure_step(dataclasses.replace(cfg)).breakdown.peak
            traced = trace_step(cfg).worst.peak
            analytic = estimate_memory(cfg.model, build_layout(cfg), cfg.training, cfg.hardware,
                                       cfg.optimizer).worst.peak
            speed = tokens_per_s(cfg, args.steps)
            baseline = baseline or speed
            table.add_row(name, f"{measured / MiB:.2f}", f"{traced / MiB:.2f}", f"{traced / measured - 1:+.1%}",
                          f"{analytic / MiB:.2f}", f"{analytic / measured - 1:+.1%}", f"{speed:,.0f}",
                          f"{speed / baseline:.2f}x")
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
