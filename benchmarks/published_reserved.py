"""The traced estimate's replayed caching allocator against the published `reserved` memory figures.

    PYTHONPATH=src python benchmarks/published_reserved.py [--only SUBSTRING ...]

torchtitan publishes torch.cuda.max_memory_reserved. For each published memory row the traced
estimator can run (trainfit trains the layout), this traces the row's config as `trainfit estimate
--traced` does and prints the tensors' peak, the reserved peak the allocator's rules reach over the
step's allocations (memory/traced/caching_allocator.py; the traced estimate's `reserved_peak`), its error
against the published figure, and the analytic peak x (1 + the assumed fragmentation) beside it.
About 10-20 s a row on 2 cores; rows that cannot be traced say why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_parallel as published  # noqa: E402 (beside this script)
from trainfit.config import ConfigError  # noqa: E402
from trainfit.estimate import estimate  # noqa: E402
from trainfit.memory import ALLOCATOR_FRAGMENTATION  # noqa: E402
from trainfit.traced import trace_step  # noqa: E402

GIB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these")
    args = parser.parse_args()
    rows = [r for r in published.CONFIGS if r.overrides and r.memory is not None and r.memory_stat == "reserved"
            and (not args.only or any(s in r.name for s in args.only))]
    table = Table(title="published reserved memory against the replayed caching allocator (GiB per GPU)")
    for column in ("row", "published", "traced tensors", "replayed reserved", "error", "analytic x (1 + frag)",
                   "error "):
        table.add_column(column, justify="left" if column == "row" else "right")
    replayed, analytic, skipped = [], [], []
    for row in rows:
        cfg = published.build_config(row)
        try:
            traced = trace_step(cfg).worst
        except ConfigError as e:
            skipped.append(f"{row.name}: {e}")
            continue
        published_bytes = row.memory * (GIB if row.memory_unit == "GiB" else 1e9)
        assumed = estimate(cfg).worst.peak * (1 + ALLOCATOR_FRAGMENTATION)
        replayed.append(traced.reserved_peak / published_bytes - 1)
        analytic.append(assumed / published_bytes - 1)
        table.add_row(row.name, f"{row.memory:.1f}", f"{traced.peak / GIB:.1f}", f"{traced.reserved_peak / GIB:.1f}",
                      f"{replayed[-1]:+.1%}", f"{assumed / GIB:.1f}", f"{analytic[-1]:+.1%}")
        Console(stderr=True).print(f"traced {row.name}", style="dim")
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    if replayed:
        console.print(f"median |error|: replayed {statistics.median(abs(e) for e in replayed):.1%}, analytic x "
                      f"(1 + {ALLOCATOR_FRAGMENTATION}) {statistics.median(abs(e) for e in analytic):.1%} "
                      f"({len(replayed)} rows)")
    for line in skipped:
        console.print(f"not traced: {line}")


if __name__ == "__main__":
    main()
