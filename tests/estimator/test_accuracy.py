"""The estimators against real CPU steps (their tensors' peak, with the allocator read beside it), over
the grid of accuracy_grid.py (1, 2 and 4 gloo ranks; precision, optimizer, checkpointing, ZeRO
stage, HSDP, batch shape, dense and MoE models). Per configuration:

- every rank's non_tensor bytes (the allocator's peak above the tensors') under 3% of its peak
  (NON_TENSOR_TOLERANCE), except in 16-bit dropless MoE steps, where oneDNN's per-shape cache
  may grow mid-step (accuracy_grid.per_shape_library_cache): the estimators are held to tensors
  the meter saw all of;
- traced peak within 3% of rank 0's measured peak, and every rank's measured peak within 3% of the
  traced one: rank 0's trace stands for all, no rank exempted. MoE rows (accuracy_grid.MOE_GRID and
  the first MoE rows: 4-16 experts, top-1 and top-2, shared experts, dropless and with a capacity
  factor) are held to -3% / +10% (MOE_TRACED_BOUNDS) and the analytic peak to -5% / +15%
  (MOE_ANALYTIC_BOUNDS): dropless routing is estimated at memory.moe_imbalance, a busiest expert
  at least as busy as the real one, in its worst place, so a real step may use less, never more.
  ZeRO-1 (parallel/zero.py) splits every parameter by rows, so its ranks hold equal shards
  wherever N divides the rows (every row of this grid); the traced peak phase equals the measured one;
- analytic peak within 10% of the measured peak; `forward_retained_bytes` within 10% of what the
  first forward + loss left allocated (dropless expert parallelism: the busiest rank's, as the
  estimate is), `model_states` within 10% of the trainer's own count of its
  model-state bytes (rank 0);
- analytic against traced per component: the allowed absolute difference is the larger of 10% of
  the traced component and 1% of the traced peak, so a component under a tenth of the peak is held
  to 1% of the peak;
- pipeline rows (accuracy_grid.PIPELINE_GRID: every schedule, uneven stages, micro-batch counts,
  precisions, checkpointing, FSDP, tp + SP, MoE with ep): all of the above per pipeline stage,
  against the stage's ranks, except the forward-retained bytes (a pipeline's first forward is not
  followed by its own backward) and, under zero-bubble schedules, the per-component check
  (accuracy_grid._stage_problems says why).

Each world size is measured once, by a module-scoped fixture (one start of ranks for all its rows);
the trace and the analytic estimate run per test. The suite runs every other row of the grid (74 of
148, every part of it at half: the whole grid is 11 of the suite's minutes on 2 cores);
TRAINFIT_FULL_GRID=1 runs all of them, as `python benchmarks/estimator_accuracy.py` does, which
prints the whole grid as a table with the same bounds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from accuracy_grid import GRID, Measured, Row, analytic, measure_rows, problems, trace

ROWS = GRID if os.environ.get("TRAINFIT_FULL_GRID") == "1" else GRID[::2]

# Configurations measured on 1, 2 and 4 gloo ranks. The first test of each world size also runs
# its module-scoped measurement of every row: minutes on a busy 2-core machine, so a hang guard of
# 30 min rather than pytest-timeout's 600 s (pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _measure_world(world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return measure_rows([row for row in ROWS if row.world == world], tmp_path_factory.mktemp(f"x{world}"))


@pytest.fixture(scope="module")
def measured_on_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return _measure_world(1, tmp_path_factory)


@pytest.fixture(scope="module")
def measured_on_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return _measure_world(2, tmp_path_factory)


@pytest.fixture(scope="module")
def measured_on_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return _measure_world(4, tmp_path_factory)


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_estimates_match_a_measured_step(row: Row, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    measured: Measured = request.getfixturevalue(f"measured_on_{row.world}")[row.name]
    found = problems(row, measured, trace(row, tmp_path), analytic(row, tmp_path))
    if found:
        pytest.fail(f"{row.name}:\n  " + "\n  ".join(found))

