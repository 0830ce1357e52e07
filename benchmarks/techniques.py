"""Each memory/compute technique's measured effect on this machine against its estimate: one baseline
(the accuracy grid's Llama shape with a 4,096-word vocabulary, bf16-mixed, AdamW, one process) and the
same run with one technique switched on. Per row: the peak measured at the allocator (a watched step,
then a measured one: memory/measured/attribution.py), both estimators' peaks and their errors, the change
against the baseline, and tokens/s over timed steps after two warm-up steps (compilation, where there
is any, happens in the warm-up and is left out).

CPU numbers: fp8 matmuls are emulated by torch on CPU and say nothing of an H100's fp8 speed; the
compiled and 8-bit rows compile in their warm-up. The machine may be shared: tokens/s is the median
of --repeats timings.

    PYTHONPATH=src python benchmarks/techniques.py [--steps 6] [--repeats 3] [--only chunked fp8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _analytic import memory_of  # noqa: E402
from _runs import run_config  # noqa: E402
from trainfit.config import Config  # noqa: E402
from trainfit.traced import trace_step  # noqa: E402
from trainfit.train.distributed import World  # noqa: E402
from trainfit.train.trainer import Trainer, measure_step  # noqa: E402

MiB = 2**20
BASELINE = ("--model.preset=debug", "--model.ffn_dim=384", "--model.dim=128", "--model.vocab_size=4096",
            "--model.max_seq_len=256", "--training.seq_len=256", "--training.micro_batch_size=4",
            "--training.global_batch_size=4", "--precision.mode=bf16-mixed")
"""tests/estimator/accuracy_grid.py's WIDE_VOCABULARY row in bf16-mixed: 2 blocks, GQA, SwiGLU; its logits
are about the size of the blocks' activations, so the chunked loss shows."""
TECHNIQUES: dict[str, tuple[str, ...]] = {
    "baseline (bf16-mixed, AdamW fused)": (),
    "chunked loss (256 tokens)": ("--memory.chunked_loss=true", "--memory.loss_chunk_tokens=256"),
    "selective checkpointing": ("--memory.activation_checkpointing=selective",),
    "full checkpointing": ("--memory.activation_checkpointing=full",),
    "fp8 tensorwise": ("--precision.mode=fp8-mixed",),
    "fp8 rowwise": ("--precision.mode=fp8-mixed", "--precision.fp8_scaling=rowwise"),
    "torch.compile per block": ("--training.compile=true",),
    "AdamW foreach (not fused)": ("--optimizer.fused=false",),
    "Adafactor": ("--optimizer.name=adafactor",),
    "adamw-8bit (torchao)": ("--optimizer.name=adamw-8bit",),
    "bf16-pure": ("--precision.mode=bf16-pure",),
}


def tokens_per_s(cfg: Config, steps: int) -> float:
    """Tokens per second of `steps` train steps after two warm-up steps (one process)."""
    torch._dynamo.reset()
    trainer = Trainer(cfg, world=World())
    for _ in range(2):
        trainer.train_step()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = time.perf_counter() - start
    trainer.close()
    return steps * trainer.layout.global_batch_size * cfg.training.seq_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timings per technique (the median is shown)")
    parser.add_argument("--only", nargs="*", default=[], help="techniques whose name contains one of these")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: comparable on a shared 2-core machine
    table = Table(title="techniques against the baseline (1 process, CPU, 1 thread; MiB; error = estimate / "
                        "measured - 1)")
    for column in ("technique", "measured", "vs baseline", "traced", "analytic", "tokens/s", "vs baseline"):
        table.add_column(column, justify="right")
    base: dict[str, float] = {}
    for name, overrides in TECHNIQUES.items():
        if args.only and base and not any(word in name for word in args.only):
            continue
        cfg = run_config(Path(tempfile.mkdtemp()), *BASELINE, *overrides, "--checkpoint.resume=never")
        torch._dynamo.reset()
        peak = measure_step(cfg).breakdown.peak
        traced = trace_step(cfg).per_stage[0].peak
        analytic = memory_of(cfg).worst.peak
        speed = statistics.median(tokens_per_s(cfg, args.steps) for _ in range(args.repeats))
        base = base or {"peak": peak, "speed": speed}
        table.add_row(name, f"{peak / MiB:.2f}", f"{peak / base['peak'] - 1:+.1%}",
                      f"{traced / MiB:.2f} ({traced / peak - 1:+.1%})",
                      f"{analytic / MiB:.2f} ({analytic / peak - 1:+.1%})",
                      f"{speed:,.0f}", f"{speed / base['speed']:.2f}x")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
