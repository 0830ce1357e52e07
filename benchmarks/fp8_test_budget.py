"""The fp8 GEMM work of the tests: FLOPs through torch._scaled_mm per test, and the time each would
take on a CPU without fp8 hardware (tests/_fp8_flops.REFERENCE_FLOPS_PER_S), where torch._scaled_mm
runs a reference kernel.

Two parts:
- the tests that run fp8 (FP8_TESTS, or the pytest arguments given), run by pytest with
  TRAINFIT_FP8_FLOPS_REPORT: tests/conftest.py counts every test's FLOPs, its rank processes'
  included, and writes them;
- the fp8 rows of the estimator accuracy grid (tests/estimator/accuracy_grid.FP8_GRID), each measured
  as tests/estimator/test_accuracy.py measures it, under the same counter. test_accuracy.py measures
  all the rows of one world size in one module fixture, so the first test of each world size carries
  the fp8 work of that world's rows (`in suite`: the rows of its half grid, GRID[::2]).

    python benchmarks/fp8_test_budget.py [--grid-only | --tests-only] [PYTEST_ARGS ...]

`python benchmarks/fp8_test_budget.py --tests-only tests` counts the whole suite.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "estimator")]

from _fp8_flops import (  # noqa: E402
    BUDGET_FLOPS,
    RANKS_DIR_ENV,
    REFERENCE_FLOPS_PER_S,
    REPORT_ENV,
    ScaledMMCounter,
    ranks_flops,
)

FP8_TESTS = ["tests/unit/test_float8.py", "tests/unit/test_fp8_matmul.py", "tests/unit/test_fp8_budget.py",
             "tests/unit/test_calibrate.py", "tests/integration/test_fp8_training.py",
             "tests/distributed/test_fp8_parity.py"]
"""The test files that mention fp8 and run something (`grep -ril 'fp8\\|float8' tests/`), but for the
accuracy grid's; the others (test_timing, test_plan, test_hardware, test_bad_inputs) only estimate or
validate configs. test_calibrate's quick calibration runs as a command, uncounted."""


def pytest_flops(args: list[str]) -> list[tuple[str, int]]:
    """(test, FLOPs) of every test pytest runs with `args` that did fp8 work."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.tsv")
        env = {**os.environ, REPORT_ENV: str(report)}
        # one process (-n 0): the report is the session's, written once at its end
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args], cwd=ROOT,
                       env=env, check=False)
        lines = report.read_text().splitlines()[1:-1]  # no header, no total
    return [(name, round(float(gflop) * 1e9)) for name, gflop, *_ in (line.split("\t") for line in lines)]


def grid_flops() -> list[tuple[str, int]]:
    """(row, FLOPs) of each fp8 row of the accuracy grid, measured after a row of the same world size
    without fp8 (the warm-up measurement test_accuracy.py's fixtures start with)."""
    from accuracy_grid import FP8_GRID, GRID, measure_rows

    counter = ScaledMMCounter().install()
    suite = {row.name for row in GRID[::2]}
    out = []
    try:
        for row in FP8_GRID:
            warm_up = next(r for r in GRID if r.world == row.world and r not in FP8_GRID)
            with tempfile.TemporaryDirectory() as tmp:
                ranks = Path(tmp, "ranks")
                ranks.mkdir()
                os.environ[RANKS_DIR_ENV] = str(ranks)
                start = counter.flops
                measure_rows([warm_up, row], Path(tmp))
                flops = counter.flops - start + ranks_flops(ranks)
            out.append((f"accuracy grid row {row.name}" + (" (in suite)" if row.name in suite else ""), flops))
    finally:
        os.environ.pop(RANKS_DIR_ENV, None)
        counter.uninstall()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid-only", action="store_true")
    parser.add_argument("--tests-only", action="store_true")
    args, pytest_args = parser.parse_known_args()
    rows = [] if args.grid_only else pytest_flops(pytest_args or FP8_TESTS)
    rows += [] if args.tests_only else grid_flops()
    rates = REFERENCE_FLOPS_PER_S
    print(f"\n| test | fp8 GFLOP | {' | '.join(f's at {r / 1e9:g} GFLOP/s' for r in rates)} |")
    print("| --- | ---: |" + " ---: |" * len(rates))
    for name, flops in [*rows, ("total", sum(f for _, f in rows))]:
        over = " (over budget)" if name != "total" and flops > BUDGET_FLOPS else ""
        print(f"| {name}{over} | {flops / 1e9:.3f} | " + " | ".join(f"{flops / r:,.1f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
