"""Measured pipeline bubble of each schedule on CPU ranks (gloo), against the time model's formula.

For every schedule and micro-batch count, each rank times its own compute inside the schedule's
step (torch's PipelineStage forward_one_chunk, backward_one_chunk and backward_weight_one_chunk,
wrapped) and the step's wall time (Trainer.pipeline.run). What is not compute is waiting: for the
neighbour's activations or gradients (the bubble) and for gloo's send/recv. The table gives
idle / compute, the quantity parallel/schedules.bubble_fraction models ((pp - 1) / m for gpipe and 1f1b,
divided by the virtual stages for interleaved-1f1b and looped-bfs, 0 for the zero-bubble family),
averaged over the ranks and for the most idle one, and the job's tokens/s.

A ~13M-parameter Llama (8 blocks: every schedule has a block per stage at pp 2 and 4), 128-token
sequences of one row per micro-batch, fp32, one thread per rank.

    python benchmarks/pipeline_bubble.py [--pp 2|4] [--steps 3]

(re-launches itself under torchrun; the table is printed by rank 0).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv-zero-bubble",
             "dualpipev")
MODEL = ["--model.preset=", "--model.family=llama", "--model.dim=384", "--model.num_layers=8", "--model.num_heads=6",
         "--model.num_kv_heads=6", "--model.ffn_dim=1024", "--model.vocab_size=256", "--model.max_seq_len=128"]
COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""What a PipelineStage computes: the schedule's F, B (or I) and W actions."""


def overrides(run_dir: Path, pp: int, schedule: str, microbatches: int) -> list[str]:
    return [*MODEL, "--training.seq_len=128", "--training.micro_batch_size=1",
            f"--training.global_batch_size={microbatches}", f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
            "--training.eval_interval=0", "--checkpoint.resume=never", f"--checkpoint.dir={run_dir / 'ckpt'}",
            f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false", f"--hardware.num_gpus={pp}"]


def timed(clock: dict[str, float], key: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, adding its wall time to clock[key]."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            clock[key] += time.perf_counter() - start

    return wrapper


def measure(trainer: Any, steps: int) -> tuple[float, float]:
    """(idle / compute, seconds per step) of this rank over `steps` steps after a warm-up step."""
    clock = {"compute": 0.0, "step": 0.0}
    for stage in trainer.pipeline.stages:
        for name in COMPUTE:
            setattr(stage, name, timed(clock, "compute", getattr(stage, name)))
    trainer.pipeline.run = timed(clock, "step", trainer.pipeline.run)
    trainer.train_step()  # warm-up: metadata inference, optimizer states
    clock.update(compute=0.0, step=0.0)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return (clock["step"] - clock["compute"]) / clock["compute"], (time.perf_counter() - start) / steps


def run_rank(args: argparse.Namespace) -> None:
    import torch

    from trainfit.configure import load_config
    from trainfit.parallel.schedules import bubble_fraction
    from trainfit.train.trainer import Trainer

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows, worlds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            for m in (args.pp * 2, args.pp * 4):
                cfg = load_config(None, overrides(Path(tmp), args.pp, schedule, m))
                trainer = Trainer(cfg)
                worlds.append(trainer.world)
                idle, seconds = measure(trainer, args.steps)
                idles = trainer.world.gather_objects(idle)
                layout = trainer.layout
                if trainer.world.is_main:
                    formula = bubble_fraction(schedule, layout.pp, layout.num_microbatches, layout.pp_virtual_stages)
                    rows.append((schedule, layout.num_stages, m, sum(idles) / len(idles), max(idles), formula,
                                 m * cfg.training.seq_len / seconds))
                del trainer
    if worlds[0].is_main:
        print_table(rows, args.pp)
    worlds[0].close()


def print_table(rows: list, pp: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Pipeline bubble on {pp} CPU ranks (gloo): idle / compute inside the schedule's step")
    for column in ("schedule", "stages", "micro-batches", "measured (mean)", "measured (most idle rank)", "formula",
                   "tokens/s"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    for schedule, stages, m, mean, most, formula, tokens in rows:
        table.add_row(schedule, str(stages), str(m), f"{mean:.2f}", f"{most:.2f}", f"{formula:.2f}", f"{tokens:,.0f}")
    Console(width=140).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, choices=(2, 4), default=2, help="pipeline ranks")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per schedule and micro-batch count")
    args = parser.parse_args()
    if "RANK" in os.environ:
        run_rank(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.pp}",
               __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
