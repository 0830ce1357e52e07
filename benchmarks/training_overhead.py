"""trainfit's training loop against a minimal hand-written loop over the same model (goal: <= 1.05x).

Both loops train the same Llama (trainfit.models.build_model, initialized from the same seed) on the
same batches (the packaged Shakespeare slice, byte tokenizer, trainfit's BatchSampler), with the same
AdamW (foreach, weight decay on matrices only), learning-rate schedule, gradient clipping and
precision, in one process. The hand loop does only what any loop must: batch, forward (under
autocast for bf16-mixed), fp32 cross-entropy, backward, clip, step, zero_grad, schedule, loss.item().

What is timed, the same way for both: the CPU time of the process and the wall time from one step's
start to the next step's start (so everything a loop does between steps counts), median over the
steady-state steps. On a shared machine compare the CPU times: the wall clock also counts the time
other processes hold the cores. trainfit runs its real `Trainer.train()`: a listener stamps each step
at its "forward" moment, so its progress bookkeeping, stop-signal check and metrics line every
logging.interval steps are inside the interval. Left out, for both loops: the first `--skip` steps
(warm-up; trainfit's 1st step is its memory-watched one and its 2nd the allocator-measured one,
diagnostics a run pays once), evaluation and periodic checkpoints (off: training.eval_interval=0,
checkpoint.interval=0; the final checkpoint comes after the last stamp), and building the model.
Each repeat runs the hand loop and trainfit in turn (the order alternating) on a fresh model; the
table gives the median over repeats of each loop's tokens/s and of the step-time ratio trainfit/hand,
taken repeat by repeat.

    python benchmarks/training_overhead.py                    # tiny and 25M, fp32 and bf16-mixed, 3 repeats
    python benchmarks/training_overhead.py --models tiny --precisions fp32 --repeats 5 --threads 2

The parity of the two loops (same losses, step by step) is tests/integration/test_training_overhead.py.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from trainfit.config import Config
from trainfit.configure import load_config
from trainfit.models import build_model, count_params, materialize
from trainfit.train.data import BatchSampler, resolve_data
from trainfit.train.optim import lr_at
from trainfit.train.trainer import Trainer, data_cache_dir

MODELS: dict[str, tuple[str, ...]] = {
    "tiny": ("--model.preset=tiny",),
    # 25M parameters: the tiny model's shape at twice the width and layers.
    "25M": ("--model.preset=", "--model.family=llama", "--model.dim=512", "--model.num_layers=8",
            "--model.num_heads=8", "--model.num_kv_heads=4", "--model.ffn_dim=1536", "--model.vocab_size=256",
            "--model.max_seq_len=512"),
}
"""Model sizes by name: config overrides. The batch is trainfit's default: 16 x 128 tokens per step."""


def run_config(run_dir: Path, model: tuple[str, ...], precision: str, steps: int, *extra: str) -> Config:
    """A quiet one-process run writing only under `run_dir`: no evaluation, no periodic checkpoint,
    one micro-batch per step (stated, so the trainer has no derived batch size to announce)."""
    args = [*model, f"--precision.mode={precision}", f"--training.steps={steps}", "--training.eval_interval=0",
            "--checkpoint.interval=0", "--checkpoint.resume=never", f"--checkpoint.dir={run_dir / 'ckpt'}",
            f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false",
            f"--training.warmup_steps={max(1, steps // 10)}",
            "--optimizer.fused=false",  # foreach AdamW, as the hand loop and HF's Trainer here: one kernel for all
            *extra]
    batch = load_config(None, args).training.micro_batch_size
    return load_config(None, [*args, f"--training.global_batch_size={batch}"])


def hand_loop(cfg: Config, stamp: Callable[[], None] = lambda: None) -> list[float]:
    """Train `cfg` for training.steps steps with a minimal loop; returns each step's loss. `stamp` is
    called at the start of every step."""
    t, opt = cfg.training, cfg.optimizer
    data = resolve_data(cfg.data, str(data_cache_dir()))
    model = materialize(build_model(cfg.model), "cpu", t.seed)
    torch.manual_seed(t.seed)
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": t.weight_decay},
                                   {"params": vectors, "weight_decay": 0.0}],
                                  lr=t.lr, betas=opt.betas, eps=opt.eps, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, t) / t.lr)
    mixed = cfg.precision.mode == "bf16-mixed"
    assert mixed or cfg.precision.mode == "fp32", cfg.precision.mode
    sampler = BatchSampler(data.train, t.seq_len, t.micro_batch_size, t.seed)
    losses = []
    for _ in range(t.steps):
        stamp()
        inputs, targets = sampler.next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses


def trainfit_loop(cfg: Config, stamp: Callable[[], None] = lambda: None) -> list[float]:
    """Train `cfg` with trainfit's Trainer.train(); returns each step's loss. `stamp` is called at
    the start of every step's forward."""
    trainer = Trainer(cfg)
    try:
        with trainer.listening(lambda moment: stamp() if moment == "forward" else None):
            result = trainer.train()
    finally:
        trainer.close()
    return [result.losses[step] for step in range(1, cfg.training.steps + 1)]


def timed_run(loop: Callable[..., list[float]], cfg: Config, skip: int) -> tuple[float, float, list[float]]:
    """(CPU, wall) seconds from one step's start to the next, each the median over the steps after
    the first `skip`, and the loop's losses. CPU time is the process's own (all its threads): on a
    shared machine it does not count the time other processes hold the cores."""
    stamps: list[tuple[float, float]] = []
    losses = loop(cfg, lambda: stamps.append((time.process_time(), time.perf_counter())))
    steady = stamps[skip:]
    assert len(steady) >= 4, "too few steps: raise --steps"
    cpu, wall = (statistics.median(b[i] - a[i] for a, b in zip(steady, steady[1:], strict=False)) for i in (0, 1))
    return cpu, wall, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"], choices=["fp32", "bf16-mixed"])
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: 30 tiny, 12 25M)")
    parser.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the timing (>= 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    assert args.skip >= 2, "trainfit's first two steps are its memory-watched and -measured ones"
    torch.set_num_threads(args.threads)
    table = Table(title=f"training overhead: 1 process, {args.threads} thread(s), {args.repeats} repeats (medians), "
                        f"steps after the first {args.skip}; tokens/s per CPU-second and per wall-second")
    for column in ("model", "precision", "hand tok/s CPU", "trainfit tok/s CPU", "trainfit/hand CPU", "per repeat",
                   "hand tok/s wall", "trainfit tok/s wall", "trainfit/hand wall", "per repeat "):
        table.add_column(column, justify="left" if column in ("model", "precision") else "right")
    for name in args.models:
        for precision in args.precisions:
            steps = args.steps or (30 if name == "tiny" else 12)
            hand: list[tuple[float, float]] = []
            ours: list[tuple[float, float]] = []
            with tempfile.TemporaryDirectory() as tmp:
                cfg = run_config(Path(tmp), MODELS[name], precision, steps)
                for repeat in range(args.repeats):
                    pair = [(hand, hand_loop), (ours, trainfit_loop)]
                    for times, loop in pair if repeat % 2 == 0 else reversed(pair):
                        times.append(timed_run(loop, cfg, args.skip)[:2])
            tokens = cfg.training.micro_batch_size * cfg.training.seq_len
            row = [f"{name} ({count_params(build_model(cfg.model)) / 1e6:.1f}M)", precision]
            for clock in (0, 1):
                ratios = [b[clock] / a[clock] for a, b in zip(hand, ours, strict=True)]
                row += [f"{tokens / statistics.median(x[clock] for x in hand):,.0f}",
                        f"{tokens / statistics.median(x[clock] for x in ours):,.0f}",
                        f"{statistics.median(ratios):.3f}x", " ".join(f"{r:.2f}" for r in ratios)]
            table.add_row(*row)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
