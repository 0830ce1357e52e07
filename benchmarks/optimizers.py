"""Optimizers on this machine: state bytes (measured from the tensors vs memory/closed_form/analytic.py) and step
time, on one small model (the tiny preset, 3.3M parameters, fp32, one process).

Measured states: parallel/data_parallel.local_state_bytes after a first step (tensor subclasses
counted by their own tensors). Step time: the median of `--steps` optimizer steps on fixed random
gradients after two warm-up steps (adamw-8bit compiles its update in the first: excluded).

    PYTHONPATH=src python benchmarks/optimizers.py [--steps 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trainfit.configure import load_config
from trainfit.memory.closed_form import model_states
from trainfit.models import build_model, materialize
from trainfit.parallel.data_parallel import local_state_bytes
from trainfit.parallel.resolve import build_layout
from trainfit.train.optim import build_optimizer

VARIANTS = {
    "adamw (fused)": ["--optimizer.name=adamw"],
    "adamw (foreach)": ["--optimizer.name=adamw", "--optimizer.fused=false"],
    "adamw (for-loop)": ["--optimizer.name=adamw", "--optimizer.fused=false", "--optimizer.foreach=false"],
    "sgd (foreach)": ["--optimizer.name=sgd"],
    "adafactor (foreach)": ["--optimizer.name=adafactor"],
    "adafactor (for-loop)": ["--optimizer.name=adafactor", "--optimizer.foreach=false"],
    "adamw-8bit (torchao)": ["--optimizer.name=adamw-8bit"],
}


def run(overrides: list[str], steps: int) -> tuple[int, int, float]:
    cfg = load_config(None, ["--model.preset=tiny", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    materialize(model, "cpu")
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
    opt = build_optimizer(model, cfg.optimizer, cfg.training, "cpu")
    times = []
    for i in range(steps + 2):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        start = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    measured = local_state_bytes(model, opt)["optimizer"]
    analytic = model_states(cfg.model, build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer).optimizer
    return measured, analytic, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"tiny preset, fp32, CPU, {args.threads} thread(s), median of {args.steps} steps")
    print(f"{'optimizer':<22} {'states MiB':>11} {'analytic MiB':>13} {'error':>7} {'step ms':>8}")
    for name, overrides in VARIANTS.items():
        measured, analytic, ms = run(overrides, args.steps)
        error = (analytic - measured) / measured
        print(f"{name:<22} {measured / 2**20:>11.3f} {analytic / 2**20:>13.3f} {error:>+7.2%} {ms:>8.2f}")


if __name__ == "__main__":
    main()
