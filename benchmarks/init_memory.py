"""Peak host memory per rank while a Trainer builds and initializes its model, per layout.

Every rank builds the model on the meta device, parallelizes it, then allocates and initializes
only what it holds (models/init.py). The figure is the rise of the process's peak RSS across
`Trainer(cfg)` (data, model, optimizer set-up; Adam's states are created at the first step), on
each rank, against the model's full fp32 size and its 1/dp_shard share.

    python benchmarks/init_memory.py [--ranks 4] [--dim 1024 --layers 16]

(re-launches itself under torchrun once per layout; the rows are printed by rank 0 of each).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import warnings

MIB = 1024**2
LAYOUTS = {
    "1 process": (1, []),
    "DDP": (0, ["--parallel.zero_stage=0"]),
    "ZeRO-3": (0, ["--parallel.zero_stage=3"]),
    "HSDP 2x2 (ZeRO-3)": (4, ["--parallel.zero_stage=3", "--parallel.dp_replicate=2"]),
}
"""name: (processes, 0 = --ranks; overrides)."""


def model_overrides(args: argparse.Namespace) -> list[str]:
    return ["--model.preset=", "--model.family=llama", f"--model.dim={args.dim}", f"--model.num_layers={args.layers}",
            "--model.num_heads=16", "--model.num_kv_heads=16", f"--model.ffn_dim={4 * args.dim}",
            "--model.vocab_size=32000", "--model.max_seq_len=128"]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from trainfit.configure import load_config
    from trainfit.train.trainer import Trainer

    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*model_overrides(args), *LAYOUTS[args.layout][1], "--training.seq_len=128",
                                 "--training.micro_batch_size=1", f"--training.global_batch_size={world}",
                                 f"--hardware.num_gpus={world}",
                                 "--checkpoint.resume=never", f"--checkpoint.dir={tmp}/ckpt",
                                 f"--logging.dir={tmp}/logs", "--logging.progress=false"])
        before = peak_rss()
        trainer = Trainer(cfg)
        rise = peak_rss() - before
        rises = trainer.world.gather_objects(rise)
        if trainer.world.is_main:
            print(json.dumps({"layout": args.layout, "ranks": world, "params": trainer.num_params, "rises": rises}))
        if dist.is_initialized():
            dist.barrier()
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the DDP and ZeRO-3 rows")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        run_rank(args)
        return
    rows = []
    for layout, (nproc, _) in LAYOUTS.items():
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc or args.ranks}", __file__, *sys.argv[1:], f"--layout={layout}"]
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode:
            sys.exit(f"{layout} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{"))))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    full = rows[0]["params"] * 4
    print(f"model: {rows[0]['params'] / 1e6:.0f}M parameters, {full / MIB:,.0f} MiB in fp32\n")
    print(f"{'layout':<20} {'ranks':>5}  {'peak RSS rise per rank at init (MiB)':<40} {'share (MiB)':>11}")
    for row in rows:
        shards = row["ranks"] // (2 if "HSDP" in row["layout"] else 1) if "ZeRO" in row["layout"] else 1
        rises = " ".join(f"{r / MIB:,.0f}" for r in row["rises"])
        print(f"{row['layout']:<20} {row['ranks']:>5}  {rises:<40} {full / shards / MIB:>11,.0f}")


if __name__ == "__main__":
    main()
