"""How unbalanced our MoE routers are: the busiest expert's load over the balanced load, measured.

memory.moe_imbalance (the load at which dropless MoE memory is estimated) takes its default from
this table. For every configuration (experts x top-k x shared experts x model shape) a CPU
Trainer trains on the packaged corpus (its defaults: seed, lr schedule, load-balancing loss) and
every router's choices are counted in every forward: the load of an expert is the number of
(token, choice) pairs routed to it in one micro-batch, the balanced load tokens x top_k / experts.
Columns: at init (the first forward, before any update), then over the first --steps steps the
median and the largest ratio of any layer, the first step that reached it, and the ceiling (every
token's choices on the same experts: experts / top_k). The last line is the largest ratio seen anywhere.

    python benchmarks/moe_routing.py [--steps 30] [--seeds 1337 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trainfit.configure import load_config
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

SHAPES = {
    # the estimator accuracy grid's MoE shape (tests/estimator/accuracy_grid.py)
    "grid": ["--model.preset=debug-moe", "--model.dim=128", "--model.vocab_size=512", "--model.max_seq_len=256",
             "--training.seq_len=256", "--model.expert_ffn_dim=128", "--training.micro_batch_size=4",
             "--training.global_batch_size=4"],
    # the debug-moe preset as it is (dim 64, sequences of 128)
    "debug": ["--model.preset=debug-moe", "--training.seq_len=128", "--training.micro_batch_size=8",
              "--training.global_batch_size=8"],
}
GRID = [(experts, top_k, shared) for experts in (4, 8, 16) for top_k in (1, 2) for shared in (0, 1)]


def routing_ratios(shape: str, experts: int, top_k: int, shared: int, steps: int, seed: int, tmp: Path
                   ) -> list[list[float]]:
    """Per step (the first forward counts as step 0), the busiest expert's load ratio per router."""
    cfg = load_config(None, [
        *SHAPES[shape], f"--model.num_experts={experts}", f"--model.experts_per_token={top_k}",
        f"--model.num_shared_experts={shared}", f"--training.seed={seed}", f"--training.steps={steps}",
        "--training.eval_interval=0",
        "--checkpoint.interval=0", "--checkpoint.resume=never", f"--checkpoint.dir={tmp / 'ckpt'}",
        f"--logging.dir={tmp / 'logs'}", "--logging.progress=false", "--training.device=cpu",
        "--logging.traced_estimate=false"])
    trainer = Trainer(cfg, World())
    ratios: list[float] = []

    def count(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> None:
        chosen = logits.detach().float().topk(top_k, dim=-1).indices  # softmax keeps the order
        loads = torch.bincount(chosen.flatten(), minlength=experts)
        ratios.append(loads.max().item() / (chosen.numel() / experts))

    for name, module in trainer.model.named_modules():
        if name.endswith("feed_forward.router"):
            module.register_forward_hook(count)
    per_step = []
    try:
        for _ in range(steps):
            ratios.clear()
            trainer.train_step()
            per_step.append(list(ratios))
    finally:
        trainer.close()
    return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="*", default=[1337])
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny steps; a second thread only spins on a shared 2-core machine
    table = Table(title=f"busiest expert's load / balanced load, first {args.steps} steps on the packaged corpus")
    for header in ("shape", "experts", "top-k", "shared", "seed", "at init", "median", "max", "at step", "ceiling"):
        table.add_column(header, justify="left" if header == "shape" else "right")
    start, worst = time.perf_counter(), (0.0, "")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for experts, top_k, shared in GRID:
                for seed in args.seeds:
                    print(f"training {shape} E={experts} k={top_k} shared={shared} seed={seed}", file=sys.stderr,
                          flush=True)
                    steps = routing_ratios(shape, experts, top_k, shared, args.steps, seed, Path(tmp))
                    every = [r for step in steps for r in step]
                    label = f"{shape} E={experts} k={top_k} shared={shared} seed={seed}"
                    worst = max(worst, (max(every), label))
                    table.add_row(shape, str(experts), str(top_k), str(shared), str(seed),
                                  f"{max(steps[0]):.2f}", f"{statistics.median(every):.2f}", f"{max(every):.2f}",
                                  str(next(i for i, step in enumerate(steps) if max(step) == max(every))),
                                  f"{experts / top_k:.0f}")
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    console.print(f"largest ratio: {worst[0]:.2f} ({worst[1]}); {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
