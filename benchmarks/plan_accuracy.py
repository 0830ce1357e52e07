"""The time model against measured step times on this machine, with its calibrated profile.

    python benchmarks/plan_accuracy.py [--profile cpu.toml] [--only NAME ...] [--steps 8] [--repeats 3]

Each configuration trains `--steps` steps of a small Llama on 1, 2 or 4 gloo ranks (one thread
each, OMP_NUM_THREADS=1, as `trainfit calibrate --threads 1` measures); the measured step time is
the median over the steps after the memory meter's two (metrics.jsonl's tokens/s of rank 0), and
over `--repeats` fresh runs (on a shared virtual machine a process's speed can differ by 30% from
the next one's, though its own steps agree within a few per cent). The
prediction is `trainfit estimate`'s step_time_s for the same config with `--hardware.profile`
(measured by `trainfit calibrate --threads 1 --max-ranks 4 --out PROFILE` first when the file does not
exist). Run it at a high priority (`nice -n -15`, as root) when other work shares the machine.
Prints each row, the median and worst |error|, and Spearman's rank correlation (issue 15's targets:
<= 15%, >= 0.8).

Then `plan`'s choice against the measured best (`--budget-mib`, per world size of `--plan-ranks`):
the planner searches every layout of the same model on that many CPU ranks whose memory fits the
budget; its PLAN_CANDIDATES fastest predicted layouts, and the configurations above that fit the
budget, are all trained and measured. Target: the measured time of plan's first choice within 10%
of the fastest measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.plan.search import search
from trainfit.plan.space import settings_of

MODEL = ["--model.preset=", "--model.family=llama", "--model.dim=256", "--model.num_layers=4", "--model.num_heads=8",
         "--model.num_kv_heads=4", "--model.ffn_dim=768", "--model.vocab_size=512", "--model.max_seq_len=256",
         "--training.seq_len=256", "--training.global_batch_size=8", "--optimizer.name=adamw"]
Z = "--parallel.zero_stage="
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "1 rank fp32": (1, ["--training.micro_batch_size=8"]),
    "1 rank fp32 mb2": (1, ["--training.micro_batch_size=2"]),
    "1 rank selective": (1, ["--training.micro_batch_size=8", "--memory.activation_checkpointing=selective"]),
    "1 rank full AC": (1, ["--training.micro_batch_size=8", "--memory.activation_checkpointing=full"]),
    "1 rank bf16-mixed": (1, ["--training.micro_batch_size=8", "--precision.mode=bf16-mixed"]),
    "1 rank chunked loss": (1, ["--training.micro_batch_size=8", "--memory.chunked_loss=true",
                                "--memory.loss_chunk_tokens=512"]),
    "2 DDP": (2, ["--training.micro_batch_size=4", f"{Z}0"]),
    "2 ZeRO-1": (2, ["--training.micro_batch_size=4", f"{Z}1"]),
    "2 ZeRO-2": (2, ["--training.micro_batch_size=4", f"{Z}2"]),
    "2 ZeRO-3": (2, ["--training.micro_batch_size=4", f"{Z}3"]),
    "2 ZeRO-3 mb1": (2, ["--training.micro_batch_size=1", f"{Z}3"]),
    "2 ZeRO-3 full AC": (2, ["--training.micro_batch_size=4", f"{Z}3", "--memory.activation_checkpointing=full"]),
    "2 ZeRO-3 bf16": (2, ["--training.micro_batch_size=4", f"{Z}3", "--precision.mode=bf16-mixed"]),
    "2 tp2": (2, ["--training.micro_batch_size=8", "--parallel.tp=2"]),
    "2 tp2+sp": (2, ["--training.micro_batch_size=8", "--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "2 cp2": (2, ["--training.micro_batch_size=8", "--parallel.cp=2"]),
    "2 pp2 1f1b": (2, ["--training.micro_batch_size=2", "--parallel.pp=2", "--parallel.pp_schedule=1f1b"]),
    "2 pp2 gpipe": (2, ["--training.micro_batch_size=2", "--parallel.pp=2", "--parallel.pp_schedule=gpipe"]),
    "4 DDP": (4, ["--training.micro_batch_size=2", f"{Z}0"]),
    "4 ZeRO-3": (4, ["--training.micro_batch_size=2", f"{Z}3"]),
    "4 HSDP 2x2": (4, ["--training.micro_batch_size=2", f"{Z}3", "--parallel.dp_replicate=2"]),
    "4 tp2 x dp2": (4, ["--training.micro_batch_size=4", f"{Z}3", "--parallel.tp=2"]),
    "4 pp2 x dp2": (4, ["--training.micro_batch_size=2", f"{Z}3", "--parallel.pp=2"]),
    "4 cp2 x tp2": (4, ["--training.micro_batch_size=8", f"{Z}3", "--parallel.cp=2", "--parallel.tp=2"]),
}


PLAN_CANDIDATES = 6


def measured_step_s(ranks: int, args: list[str], steps: int, folder: Path) -> float:
    run = [*MODEL, *args, f"--training.steps={steps}", "--training.eval_interval=0", "--checkpoint.interval=0",
           f"--checkpoint.dir={folder / 'ckpt'}", f"--logging.dir={folder / 'logs'}", "--logging.progress=false",
           "--logging.interval=1", "--logging.traced_estimate=false", "--training.warmup_steps=1"]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "-m", "trainfit"] \
        if ranks > 1 else [sys.executable, "-m", "trainfit"]
    subprocess.run([*launcher, "train", *run], check=True, capture_output=True, env={**os.environ,
                                                                                     "OMP_NUM_THREADS": "1"})
    records = [json.loads(line) for line in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, [*MODEL, *args, f"--hardware.num_gpus={ranks}"])
    tokens = cfg.training.global_batch_size * cfg.training.seq_len
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") is not None and r.get("step", 0) > 2]
    return statistics.median(tokens / rate for rate in rates)


def median_step_s(ranks: int, args: list[str], steps: int, repeats: int) -> float:
    """measured_step_s's median over `repeats` fresh runs (each run's time on stderr when there are several)."""
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            runs.append(measured_step_s(ranks, args, steps, Path(folder)))
    if repeats > 1:
        print(f"  fresh runs: {', '.join(f'{r:.3f}' for r in runs)} s", file=sys.stderr)
    return statistics.median(runs)


def predicted(ranks: int, args: list[str], profile: str, budget_mib: float | None = None) -> tuple[float, bool]:
    """(predicted step time, whether it fits `budget_mib`)."""
    budget = [f"--hardware.memory_gib={budget_mib / 1024}"] if budget_mib else []
    cfg = load_config(None, [*MODEL, *args, f"--hardware.num_gpus={ranks}", f"--hardware.profile={profile}", *budget])
    est = estimate(cfg)
    return est.perf.time["step_time_s"], est.fits


def plan_choices(ranks: int, profile: str, budget_mib: float) -> list[tuple[list[str], float]]:
    """The planner's PLAN_CANDIDATES fastest predicted layouts that fit (the overrides that differ from
    the default layout, predicted step time)."""
    cfg = load_config(None, [*MODEL, f"--hardware.num_gpus={ranks}", f"--hardware.profile={profile}",
                             f"--hardware.memory_gib={budget_mib / 1024}"])
    fixed = frozenset(arg[2:].split("=")[0] for arg in MODEL) | {"hardware.num_gpus", "hardware.memory_gib"}
    plan = search(cfg, fixed, top=PLAN_CANDIDATES, exhaustive=True)
    ranked = sorted(plan.fitting, key=lambda c: c.step_time_s)[:PLAN_CANDIDATES]
    default = settings_of(cfg)
    return [([f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
              for key, value in c.settings().items() if value != default[key]], c.step_time_s) for c in ranked]


def check_plan(ranks: int, profile: str, budget_mib: float, steps: int, repeats: int) -> None:
    """Train plan's choices and the configurations that fit the budget; print plan's first against the best."""
    runs = {f"plan #{i + 1}": (args, p) for i, (args, p) in enumerate(plan_choices(ranks, profile, budget_mib))}
    for name, (n, extra) in CONFIGS.items():
        p, fits = predicted(n, extra, profile, budget_mib)
        if n == ranks and fits:
            runs[name] = (extra, p)
    table = Table(title=f"plan on {ranks} CPU ranks, {budget_mib:g} MiB budget: predicted and measured step time, s")
    for column in ("layout", "predicted", "measured"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    measured = {}
    for name, (extra, p) in runs.items():
        measured[name] = median_step_s(ranks, extra, steps, repeats)
        table.add_row(f"{name}: {' '.join(a[2:] for a in extra) or '(defaults)'}", f"{p:.3f}",
                      f"{measured[name]:.3f}")
        print(f"{name}: predicted {p:.3f} s, measured {measured[name]:.3f} s", file=sys.stderr)
    Console().print(table)
    best = min(measured, key=measured.__getitem__)
    print(f"plan's first choice measured {measured['plan #1']:.3f} s; the fastest measured, {best}, "
          f"{measured[best]:.3f} s: plan's choice is {measured['plan #1'] / measured[best] - 1:+.1%} (target <= 10%)")


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="cpu-profile.toml")
    parser.add_argument("--only", nargs="*", help="configuration names (default: all)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="fresh runs per configuration (their median)")
    parser.add_argument("--budget-mib", type=float, default=120.0, help="device memory for the plan check")
    parser.add_argument("--plan-ranks", type=int, nargs="*", default=[2], help="world sizes of the plan check")
    parser.add_argument("--skip-table", action="store_true", help="only the plan check")
    args = parser.parse_args()
    if not Path(args.profile).exists():
        calibrate = ["calibrate", "--threads", "1", "--max-ranks", "4", "--out", args.profile]
        subprocess.run([sys.executable, "-m", "trainfit", *calibrate], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if not args.skip_table:
        accuracy_table(args)
    for ranks in args.plan_ranks:
        check_plan(ranks, args.profile, args.budget_mib, args.steps, args.repeats)


def accuracy_table(args: argparse.Namespace) -> None:
    table = Table(title=f"predicted (hardware.profile={args.profile}) vs measured step time, s")
    for column in ("configuration", "ranks", "measured", "predicted", "error"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    measured_s, predicted_s = [], []
    for name, (ranks, extra) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        m = median_step_s(ranks, extra, args.steps, args.repeats)
        p = predicted(ranks, extra, args.profile)[0]
        measured_s.append(m)
        predicted_s.append(p)
        table.add_row(name, str(ranks), f"{m:.3f}", f"{p:.3f}", f"{p / m - 1:+.1%}")
        print(f"{name}: measured {m:.3f} s, predicted {p:.3f} s", file=sys.stderr)
    Console().print(table)
    errors = [abs(p / m - 1) for m, p in zip(measured_s, predicted_s, strict=True)]
    print(f"{len(errors)} configurations: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
          f"Spearman {spearman(measured_s, predicted_s):.2f}")


if __name__ == "__main__":
    main()
