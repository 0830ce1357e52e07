"""Per-rank memory and throughput of the layouts trainfit trains: a ~50M-parameter Llama on CPU ranks
(gloo), the same global batch for each layout of a family.

- `--family data` (4 ranks): DDP, ZeRO-1/2/3, HSDP, offload; 4 sequences per step, one per rank.
- `--family model` (2 ranks): data parallelism (DDP, ZeRO-3) beside tensor parallelism (with and
  without sequence parallelism) and context parallelism, 2 sequences per step: the data-parallel
  ranks read one each, the tensor- and context-parallel ranks share both.

For each layout, every rank runs a watched warm-up step, one measured step as `trainfit train` does
(Trainer.measured_step: the live tensors' peak, counted after every operator with glibc's in-use
bytes read beside them, memory/measured/attribution.py; the largest over the ranks), then timed steps; and this
rank's model-state tensors once the optimizer is about to step (params, master weights, grads,
optimizer: local shard bytes, rank 0; ZeRO-1's grads are its flat buffers plus its master shards'
gradients). "estimate" is memory/closed_form/analytic.py's model states at that moment (model_states) and
peak (estimate_memory) for the same config. On a CPU "offload" moves nothing (host and device are
the same memory): its row shows the cost of the offload code path, not its saving.

    python benchmarks/layouts.py [--family data|model] [--steps 2]

(re-launches itself under torchrun; the table is printed by rank 0).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MIB = 1024**2
MODEL = ["--model.preset=", "--model.family=llama", "--model.dim=640", "--model.num_layers=10",
         "--model.num_heads=10", "--model.num_kv_heads=10", "--model.ffn_dim=1792", "--model.vocab_size=256",
         "--model.max_seq_len=128"]
DATA_LAYOUTS = {
    "DDP (ZeRO-0)": ["--parallel.zero_stage=0"],
    "ZeRO-1": ["--parallel.zero_stage=1"],
    "ZeRO-1 bf16-mixed": ["--parallel.zero_stage=1", "--precision.mode=bf16-mixed"],
    "ZeRO-2": ["--parallel.zero_stage=2"],
    "ZeRO-3": ["--parallel.zero_stage=3"],
    "HSDP 2x2 (ZeRO-3)": ["--parallel.zero_stage=3", "--parallel.dp_replicate=2"],
    "ZeRO-3 + offload": ["--parallel.zero_stage=3", "--memory.offload=optimizer+params"],
}
SHARED_BATCH = "--training.micro_batch_size=2"  # tp and cp ranks read the same 2 sequences
MODEL_LAYOUTS = {
    "dp2 DDP": ["--parallel.zero_stage=0"],
    "dp2 ZeRO-3": ["--parallel.zero_stage=3"],
    "tp2": ["--parallel.tp=2", SHARED_BATCH],
    "tp2 + SP": ["--parallel.tp=2", "--parallel.sequence_parallel=true", SHARED_BATCH],
    "cp2 (DDP over cp)": ["--parallel.cp=2", "--parallel.zero_stage=0", SHARED_BATCH],
    "cp2 ZeRO-3": ["--parallel.cp=2", "--parallel.zero_stage=3", SHARED_BATCH],
}
FAMILIES = {"data": (DATA_LAYOUTS, 4), "model": (MODEL_LAYOUTS, 2)}


def overrides(run_dir: Path, nproc: int, layout: list[str]) -> list[str]:
    return [*MODEL, "--training.seq_len=128", "--training.micro_batch_size=1",
            f"--training.global_batch_size={nproc}", "--training.eval_interval=0", "--checkpoint.resume=never",
            f"--checkpoint.dir={run_dir / 'ckpt'}", f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false",
            f"--hardware.num_gpus={nproc}", *layout]


def estimate(cfg) -> tuple[int, int]:
    """(peak, model states once the optimizer is about to step) of the analytic estimate."""
    from trainfit.memory.closed_form import estimate_memory, model_states
    from trainfit.parallel.resolve import build_layout

    args = (cfg.model, build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer)
    return estimate_memory(*args).worst.peak, model_states(*args).model_states


def run_rank(args: argparse.Namespace) -> None:
    from trainfit.configure import load_config
    from trainfit.train.trainer import Trainer

    warnings.filterwarnings("ignore")
    rows, worlds = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in FAMILIES[args.family][0].items():
            gc.collect()
            cfg = load_config(None, overrides(Path(tmp), args.nproc, layout))
            trainer = Trainer(cfg)
            world = trainer.world
            worlds.append(world)  # the first one created the process group
            trainer.watched_step()  # warm-up: optimizer states, one-time buffers, DDP's buckets (known to the meter)
            stats = trainer.measured_step()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            seconds = (time.perf_counter() - start) / args.steps
            peaks = world.gather_objects(stats.peak_memory_bytes)
            if world.is_main:
                tokens_per_s = cfg.training.global_batch_size * cfg.training.seq_len / seconds
                rows.append((name, stats.state_bytes, max(peaks), tokens_per_s, estimate(cfg), trainer.num_params))
            del trainer, stats
    if worlds[0].is_main:
        print_table(rows, args.nproc)
    worlds[0].close()


def print_table(rows: list, nproc: int) -> None:
    from rich.console import Console
    from rich.table import Table

    num_params = rows[0][-1]
    table = Table(title=f"{num_params / 1e6:.1f}M-parameter Llama, AdamW (fp32 unless named), {nproc} CPU ranks "
                        f"(gloo), global batch {nproc} x 128 tokens; MiB per rank, tokens/s of the whole job")
    for column in ("layout", "params", "master", "grads", "optimizer", "model states", "estimate (states)", "peak",
                   "estimate (peak)", "tokens/s"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for name, states, peak, tokens_per_s, est, _ in rows:
        est_peak, est_states = (f"{est[0] / MIB:,.0f}", f"{est[1] / MIB:,.0f}") if est else ("-", "-")
        columns = ("params", "master_params", "grads", "optimizer")
        table.add_row(name, *(f"{states.get(k, 0) / MIB:,.0f}" for k in columns),
                      f"{sum(states.values()) / MIB:,.0f}", est_states, f"{peak / MIB:,.0f}", est_peak,
                      f"{tokens_per_s:,.0f}")
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="data", help="which layouts to compare")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout")
    args = parser.parse_args()
    args.nproc = FAMILIES[args.family][1]
    if "RANK" in os.environ:
        run_rank(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
