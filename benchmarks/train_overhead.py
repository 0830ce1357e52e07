"""Tokens/s of `trainfit train` against a minimal hand-written PyTorch loop.

Same model, data, batch and precision; the hand loop does only what any loop must (sample,
forward, loss, backward, clip, step). trainfit's time is the wall clock of `Trainer.train()`
(progress bar, metrics, per-operator memory measurement on its measured step included), minus
its final checkpoint save, which the hand loop does not do. Runs alternate to share the noise.

    python benchmarks/train_overhead.py [--steps 60] [--repeats 3] [--preset tiny] [--precision fp32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from trainfit.config import load_config
from trainfit.models import build_model, materialize
from trainfit.precision import precision_policy
from trainfit.train.data import BatchSampler, resolve_data
from trainfit.train.optim import build_optimizer, build_scheduler
from trainfit.train.trainer import Trainer, data_cache_dir


def overrides(run_dir: Path, args: argparse.Namespace) -> list[str]:
    return [f"--model.preset={args.preset}", f"--training.steps={args.steps}",
            f"--precision.mode={args.precision}", "--training.eval_interval=0", "--checkpoint.interval=0",
            "--checkpoint.resume=never", f"--checkpoint.dir={run_dir / 'ckpt'}",
            f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false"]


def trainfit_tokens_per_s(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_config(None, overrides(Path(tmp), args)))
        save = trainer.save
        saved_seconds = 0.0

        def timed_save() -> Path:
            nonlocal saved_seconds
            start = time.perf_counter()
            path = save()
            saved_seconds += time.perf_counter() - start
            return path

        trainer.save = timed_save  # type: ignore[method-assign]
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start - saved_seconds
        t = trainer.cfg.training
        return args.steps * t.global_batch_size * t.seq_len / seconds


def hand_loop_tokens_per_s(args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, overrides(Path(tmp), args))
    t = cfg.training
    policy = precision_policy(cfg.precision.mode, "cpu")
    data = resolve_data(cfg.data, str(data_cache_dir()))
    torch.manual_seed(t.seed)
    model = materialize(build_model(cfg.model), "cpu")
    policy.prepare_model(model)
    optimizer = build_optimizer(model, cfg.optimizer, t, "cpu")
    scheduler = build_scheduler(optimizer, t)
    sampler = BatchSampler(data.train, t.seq_len, t.micro_batch_size, t.seed)
    start = time.perf_counter()
    for _ in range(args.steps):
        inputs, targets = sampler.next_batch()
        with policy.autocast():
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss.item()
    seconds = time.perf_counter() - start
    return args.steps * t.global_batch_size * t.seq_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    hand_loop_tokens_per_s(argparse.Namespace(**{**vars(args), "steps": 5}))  # warm caches and data
    hand, ours = [], []
    for _ in range(args.repeats):
        hand.append(hand_loop_tokens_per_s(args))
        ours.append(trainfit_tokens_per_s(args))
    table = Table(title=f"train overhead: {args.preset}, {args.precision}, {args.steps} steps x {args.repeats}")
    for column in ("loop", "tokens/s (median)", "runs"):
        table.add_column(column)
    table.add_row("hand-written PyTorch", f"{statistics.median(hand):,.0f}", ", ".join(f"{x:,.0f}" for x in hand))
    table.add_row("trainfit train", f"{statistics.median(ours):,.0f}", ", ".join(f"{x:,.0f}" for x in ours))
    overhead = 1 - statistics.median(ours) / statistics.median(hand)
    table.add_row("overhead", f"{overhead:+.1%}", "target < 5%")
    Console().print(table)


if __name__ == "__main__":
    main()
