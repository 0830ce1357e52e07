"""How fast `trainfit plan` answers, as a whole process (start to printed table), and how much it searched.

    python benchmarks/plan_speed.py

Targets, on a 2-core machine: llama3.1-405b on 16,384 H100s under 2 s and llama3-8b on 8 H100s under 0.5 s
(issue 15), llama3-70b on 64 H100s under 3 s. An MoE model with dense layers among its MoE ones is timed beside
the same model whose layers are all MoE. The in-process search time and the search's counts come from `--json`.

    python benchmarks/plan_speed.py --record "REASON"   # ...and keep the counts (plan_speed_record.json)

The counts (layouts, settings visited, memory and time estimates) are deterministic, unlike the seconds: the
record is a gate (tests/unit/test_plan_counts.py) that fails when a change makes the search estimate more for
GATED's cases, unless re-recorded with a reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainfit.tables import print_table

CASES = {
    "llama3-8b, 8 x H100": (["--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                             "--training.seq_len=8192", "--training.global_batch_size=64"], 0.5),
    "llama3-70b, 64 x H100": (["--model.preset=llama3-70b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=64",
                               "--training.seq_len=8192", "--training.global_batch_size=512"], 3.0),
    "llama3.1-405b, 16,384 x H100": (["--model.preset=llama3.1-405b", "--hardware.gpu=H100-SXM-80GB",
                                      "--hardware.num_gpus=16384", "--training.seq_len=8192",
                                      "--training.global_batch_size=2048"], 2.0),
    "qwen3-30b-a3b, 8 x H100": (_QWEN3_MOE := ["--model.preset=qwen3-30b-a3b", "--hardware.gpu=H100-SXM-80GB",
                                               "--hardware.num_gpus=8", "--training.seq_len=4096",
                                               "--training.global_batch_size=64"], None),
    # layers that differ in their tensors: each kind of layer priced on its own
    "qwen3-30b-a3b, first 2 layers dense": ([*_QWEN3_MOE, "--model.moe_dense_layers=2"], None),
}


RECORD = Path(__file__).with_name("plan_speed_record.json")
GATED = ("llama3-70b, 64 x H100", "llama3.1-405b, 16,384 x H100")
"""The cases whose search counts the suite holds (the issue's speed targets)."""
COUNTS = ("layouts", "visited", "memory_estimates", "time_estimates")


def counts(name: str) -> dict[str, int]:
    """The search's counts of a case, from one `trainfit plan --json`."""
    search = run(CASES[name][0])[1]["search"]
    return {key: search[key] for key in COUNTS}


def run(args: list[str]) -> tuple[float, dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainfit", "plan", *args, "--top", "5", "--json"],
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - start, json.loads(proc.stdout)


def main(repeats: int = 3) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", metavar="REASON", help=f"write GATED's counts to {RECORD.name}")
    args = parser.parse_args()
    if args.record:
        RECORD.write_text(json.dumps({"recorded": datetime.date.today().isoformat(), "reason": args.record,
                                      "cases": {name: counts(name) for name in GATED}}, indent=1) + "\n")
        Console().print(f"wrote {RECORD}")
        return
    table = Table(title="trainfit plan speed (whole process, median of 3)")
    for column in ("case", "process s", "search s", "target", "layouts", "tried", "memory est.", "time est.",
                   "fastest tokens/s"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for name, (args, target) in CASES.items():
        runs = [run(args) for _ in range(repeats)]
        wall = statistics.median(w for w, _ in runs)
        out = runs[0][1]
        s = out["search"]
        table.add_row(name, f"{wall:.2f}", f"{statistics.median(o['search']['seconds'] for _, o in runs):.2f}",
                      f"< {target} s" if target else "", f"{s['layouts']:,}", f"{s['visited']:,}",
                      f"{s['memory_estimates']:,}", f"{s['time_estimates']:,}",
                      f"{out['candidates'][0]['tokens_per_second']:,.0f}")
    print_table(table, Console())


if __name__ == "__main__":
    main()
