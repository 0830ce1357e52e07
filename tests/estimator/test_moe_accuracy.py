"""The estimators against measured MoE training steps (accuracy_grid.MOE_GRID): top-1 and top-2,
4 to 16 experts, shared experts, dropless routing and capacity factors, every checkpointing
policy, fp32 / bf16-mixed / fp16-mixed, one and two gloo ranks.

Dropless routing is data-dependent: both estimators size the busiest expert at
memory.moe_imbalance (its default is above what benchmarks/moe_routing.py measured), in its worst
place, so a real step may use less than predicted but not more: traced within -3% / +10% of the
measured peak, analytic within -5% / +15% (accuracy_grid.MOE_*_BOUNDS); with a capacity factor the
shapes are fixed and both must be as close as for dense models. The other checks are those of
test_accuracy.py (forward-retained bytes, model states, analytic vs traced per component, peak
phase). Each world size is measured once per module (one spawn for the two-rank rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from accuracy_grid import MOE_GRID, Measured, Row, analytic, measure_rows, problems, trace


def _measure_world(world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return measure_rows([row for row in MOE_GRID if row.world == world], tmp_path_factory.mktemp(f"moe-x{world}"))


@pytest.fixture(scope="module")
def moe_measured_on_1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return _measure_world(1, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_measured_on_2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Measured]:
    return _measure_world(2, tmp_path_factory)


@pytest.mark.parametrize("row", MOE_GRID, ids=[row.name for row in MOE_GRID])
def test_moe_estimates_bound_a_measured_step(row: Row, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    measured: Measured = request.getfixturevalue(f"moe_measured_on_{row.world}")[row.name]
    found = problems(row, measured, trace(row, tmp_path), analytic(row, tmp_path))
    if found:
        pytest.fail(f"{row.name}:\n  " + "\n  ".join(found))
