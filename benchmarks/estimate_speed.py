"""How fast `trainfit estimate` answers: one analytic estimate in-process, and the whole command.

    python benchmarks/estimate_speed.py

Targets (issue 3): llama3.1-405b on 16,384 GPUs with 4-D parallelism under 5 ms of compute; the
`trainfit estimate` process, start to printed table, under 0.5 s (`import torch` alone is ~1.7 s
on these machines, which is why the analytic path never imports it).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from trainfit.configure import load_config
from trainfit.estimate import estimate

# llama3.1-405b: 126 layers, so pp must divide 126 (2, 3, 6, 7, ...); tp 8 in a node, cp 2, pp 2, dp 512.
LAYOUT_405B = ["--model.preset=llama3.1-405b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=16384",
               "--parallel.tp=8", "--parallel.pp=2", "--parallel.cp=2", "--parallel.zero_stage=3",
               "--precision.mode=bf16-mixed", "--training.seq_len=8192", "--training.micro_batch_size=1",
               "--training.global_batch_size=2048", "--memory.activation_checkpointing=selective"]


def time_in_process(repeats: int = 200) -> list[float]:
    cfg = load_config(None, LAYOUT_405B)
    estimate(cfg)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        estimate(cfg)
        times.append(time.perf_counter() - start)
    return times


def time_command(repeats: int = 5) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "trainfit", "estimate", *LAYOUT_405B], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    compute, command = time_in_process(), time_command()
    table = Table(title="trainfit estimate speed (llama3.1-405b, 16,384 x H100, tp8 pp2 cp2 dp512)")
    for column in ("what", "median", "best", "target"):
        table.add_column(column)
    table.add_row("one estimate, in process", f"{statistics.median(compute) * 1e3:.2f} ms",
                  f"{min(compute) * 1e3:.2f} ms", "< 5 ms")
    table.add_row("`trainfit estimate` process", f"{statistics.median(command):.3f} s", f"{min(command):.3f} s",
                  "< 0.5 s")
    Console().print(table)


if __name__ == "__main__":
    main()
