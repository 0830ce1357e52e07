"""How steady is a measured step? Measures rows of the accuracy grid (tests/estimator/accuracy_grid.py)
REPEATS times each, optionally with CPU-bound processes running beside it, and prints per row the
min / median / max of the measured peak (rank 0, and the largest over the ranks) and the spread
(max - min) / median. The requirement: the same bytes within +-0.5% over 10 repeats under load.

Every repeat measures the rows as the accuracy test does: measure_rows over the grid's rows of
that world size up to the last one asked for (the process state a row meets, the kernels and
caches earlier rows left, is part of what is measured), a fresh spawn per multi-process repeat,
one discarded warm-up measurement first; `--alone` measures each row by itself instead. One-process
rows run in this process.

    python benchmarks/measure_stability.py [--rows NAME ...] [--repeats 10] [--load 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "estimator")]  # accuracy_grid and the _runs it imports

from accuracy_grid import GRID, MiB, Row, measure_rows  # noqa: E402

DEFAULT_ROWS = ["x2-llama-z1-fp16-mixed-full", "x2-llama-z3-bf16-mixed-full", "x2-llama-z0-fp32",
                "llama-fp16-mixed", "llama-bf16-mixed-full"]
REQUIRED_SPREAD = 0.005


def _burners(n: int) -> list[subprocess.Popen]:
    """`n` CPU-bound processes, the busy machine the flaky runs saw."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _groups(names: list[str], alone: bool) -> list[list[Row]]:
    """What one repeat measures together: each row alone, or per world size the grid's rows up to
    the last asked for."""
    if alone:
        return [[row for row in GRID if row.name == name] for name in names]
    groups = []
    for world in sorted({row.world for row in GRID if row.name in names}):
        rows = [row for row in GRID if row.world == world]
        last = max(i for i, row in enumerate(rows) if row.name in names)
        groups.append(rows[:last + 1])
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", default=DEFAULT_ROWS, help="grid rows, by exact name")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes to run beside the measurement")
    parser.add_argument("--alone", action="store_true",
                        help="measure each row by itself, not after the grid's earlier rows")
    args = parser.parse_args()
    by_name = {row.name: row for row in GRID}
    unknown = [name for name in args.rows if name not in by_name]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {sorted(by_name)}")
    peaks: dict[str, list[tuple[int, int]]] = {name: [] for name in args.rows}  # (rank 0, largest rank)
    burners = _burners(args.load)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                print(f"repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
                for group in _groups(args.rows, args.alone):
                    measured = measure_rows(group, Path(tmp, f"{i}"))
                    for name in args.rows:
                        if name in measured:
                            m = measured[name]
                            peaks[name].append((m.breakdown.peak, max(r.peak for r in m.ranks)))
                            print(f"  {name}: " + " ".join(f"{r.peak / MiB:.3f}" for r in m.ranks), file=sys.stderr,
                                  flush=True)
    finally:
        for p in burners:
            p.kill()
            p.wait()
    alone = " (each row alone)" if args.alone else ""
    table = Table(title=f"measured peak over {args.repeats} repeats{alone} beside {args.load} CPU-bound processes "
                        "(MiB)")
    for header in ("row", "rank 0 min", "median", "max", "spread", "all ranks max", "spread", "bytes seen"):
        table.add_column(header, justify="left" if header == "row" else "right")
    worst = 0.0
    for name, values in peaks.items():
        cells = [name]
        for column in (0, 1):
            xs = [v[column] for v in values]
            med = statistics.median(xs)
            spread = (max(xs) - min(xs)) / med
            worst = max(worst, spread)
            style = "green" if spread <= REQUIRED_SPREAD else "red"
            cells += ([f"{min(xs) / MiB:.3f}", f"{med / MiB:.3f}", f"{max(xs) / MiB:.3f}"] if column == 0 else
                      [f"{max(xs) / MiB:.3f}"]) + [f"[{style}]{spread:.2%}[/{style}]"]
        cells.append(str(len({v[0] for v in values})))
        table.add_row(*cells)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(f"worst spread {worst:.2%} (required <= {REQUIRED_SPREAD:.1%}); {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
