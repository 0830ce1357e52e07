"""How fast the traced estimator answers for big models, and how little memory it needs.

    python benchmarks/traced_speed.py [--quick] [--only=SUBSTRING]

Each configuration is traced in a fresh process, so its peak RSS (getrusage) is its own: import
torch and trainfit, build the model on the meta device, materialize it under FakeTensorMode on a
fake world of hardware.num_gpus ranks, trace one step. Targets (issue 5): llama3-8b on 8 GPUs
with ZeRO-3 in under 60 s on 2 cores and 24 GiB; llama3-70b on 64 GPUs without real weight memory.
The analytic estimate of the same configuration is shown beside the traced one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

GIB = 2**30
BIG = ["--hardware.gpu=H100-SXM-80GB", "--precision.mode=bf16-mixed", "--training.seq_len=8192",
       "--training.micro_batch_size=1"]
CASES: list[tuple[str, list[str]]] = [
    ("llama3-8b, 8 GPUs, ZeRO-3, selective AC",
     ["--model.preset=llama3-8b", *BIG, "--hardware.num_gpus=8", "--parallel.zero_stage=3",
      "--training.global_batch_size=8", "--memory.activation_checkpointing=selective"]),
    ("llama3-8b, 1 GPU, no AC",
     ["--model.preset=llama3-8b", *BIG, "--training.global_batch_size=1"]),
    ("llama3-70b, 64 GPUs, ZeRO-3, full AC",
     ["--model.preset=llama3-70b", *BIG, "--hardware.num_gpus=64", "--parallel.zero_stage=3",
      "--training.global_batch_size=64", "--memory.activation_checkpointing=full"]),
    ("mixtral-8x7b, 8 GPUs, ZeRO-3, full AC",
     ["--model.preset=mixtral-8x7b", *BIG, "--hardware.num_gpus=8", "--parallel.zero_stage=3",
      "--training.global_batch_size=8", "--memory.activation_checkpointing=full"]),
    # 3-D: 8 pipeline ranks of 1F1B (each traced: a rank's warm-up depth is its own), 8 micro-batches
    ("llama3.1-405b, 512 GPUs, tp8 x pp8 x dp8, ZeRO-3, full AC",
     ["--model.preset=llama3.1-405b", *BIG, "--hardware.num_gpus=512", "--parallel.tp=8", "--parallel.pp=8",
      "--parallel.zero_stage=3", "--training.global_batch_size=64", "--memory.activation_checkpointing=full"]),
]
QUICK = [CASES[0]]

_CHILD = """
import json, sys
from trainfit.configure import load_config
from trainfit.estimate import estimate
from trainfit.traced import trace_step
from trainfit.models.params import param_counts
cfg = load_config(None, sys.argv[1:])
est = trace_step(cfg)
print(json.dumps({"seconds": est.seconds, "rss": est.peak_rss_bytes, "ops": est.num_ops,
                  "params": param_counts(cfg.model).total, "traced": est.worst.as_dict(),
                  "module": est.peak_module, "analytic": estimate(cfg).worst.peak}))
"""


def run(overrides: list[str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, *overrides], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall"] = time.perf_counter() - start
    return result


def main() -> None:
    table = Table(title="traced estimator: one training step on fake tensors (2 shared CPU cores)")
    for column in ("configuration", "params", "fp32 weights", "trace s", "process s", "peak RSS",
                   "operators", "traced peak / GPU", "peak at", "analytic peak"):
        table.add_column(column, justify="left" if column in ("configuration", "peak at") else "right")
    only = next((arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--only=")), "")
    for name, overrides in QUICK if "--quick" in sys.argv else CASES:
        if only not in name:
            continue
        r = run(overrides)
        t = r["traced"]
        table.add_row(name, f"{r['params'] / 1e9:.1f} B", f"{4 * r['params'] / GIB:,.0f} GiB", f"{r['seconds']:.1f}",
                      f"{r['wall']:.1f}", f"{r['rss'] / GIB:.2f} GiB", f"{r['ops']:,}", f"{t['peak'] / GIB:.1f} GiB",
                      f"{t['peak_phase']}, {r['module']}", f"{r['analytic'] / GIB:.1f} GiB")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
