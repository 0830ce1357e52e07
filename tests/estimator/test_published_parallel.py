"""benchmarks/published_parallel.py's published configurations. Each row the script can express
builds a valid config and gets a finite, positive estimate. Each row it cannot express names its
source and the reason. How close the estimates come is the benchmark's to print and
test_published_record.py's to hold to the recorded errors."""

from __future__ import annotations

import math

import pytest

from _runs import load_benchmark

published = load_benchmark("published_parallel")
EXPRESSIBLE = [row for row in published.CONFIGS if row.overrides]


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.mark.parametrize("row", EXPRESSIBLE, ids=lambda row: row.name)
def test_expressible_row_builds_and_estimates(row) -> None:
    cfg = published.build_config(row)
    assert cfg.hardware.num_gpus > 1
    result = published.predict(row)
    assert all(_positive(stage.peak) for stage in result.est.memory.per_stage)
    assert _positive(result.est.perf.time["step_time_s"]) and _positive(result.est.perf.time["tokens_per_second"])
    compared = [value for value in (result.memory, result.throughput) if value is not None]
    assert compared and all(_positive(value) for value in compared)


def test_every_row_is_cited_and_explained() -> None:
    names = [row.name for row in published.CONFIGS]
    assert len(names) == len(set(names))
    for row in published.CONFIGS:
        assert row.source in published.SOURCES, row.name
        assert all(key in published.NOTES for key in row.notes), row.name
        if not row.overrides:
            assert row.notes, f"{row.name}: a row that is not estimated must say why"
            with pytest.raises(ValueError):
                published.build_config(row)
    assert EXPRESSIBLE and len(EXPRESSIBLE) < len(published.CONFIGS)
