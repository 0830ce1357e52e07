"""The planner's search counts for the speed targets' cases (benchmarks/plan_speed.py GATED) stay at or below
their record (benchmarks/plan_speed_record.json): deterministic where its seconds are not, so a change that
makes the search estimate more layouts fails here unless re-recorded with a reason
(`python benchmarks/plan_speed.py --record "REASON"`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import plan_speed  # noqa: E402 (beside the suite: the benchmark that records the counts)


def test_the_record_says_when_and_why() -> None:
    recorded = json.loads(plan_speed.RECORD.read_text())
    assert recorded["recorded"] and recorded["reason"].strip()
    assert set(recorded["cases"]) == set(plan_speed.GATED)


@pytest.mark.parametrize("name", plan_speed.GATED)
def test_the_search_estimates_no_more_than_recorded(name: str) -> None:
    recorded = json.loads(plan_speed.RECORD.read_text())["cases"][name]
    found = plan_speed.counts(name)
    more = {key: (found[key], recorded[key]) for key in plan_speed.COUNTS if found[key] > recorded[key]}
    assert not more, f"{name}: (now, recorded) {more}; if deliberate: python benchmarks/plan_speed.py --record REASON"
    assert found["memory_estimates"] > 0 and found["layouts"] > 0  # the search ran
