"""The published record as a gate (benchmarks/published_record.py says the rules): every change of the
estimators is held to the errors recorded against published runs in benchmarks/published_record.json.
A deliberate change is re-recorded with its reason:

    PYTHONPATH=src python benchmarks/published_parallel.py --record "REASON"

The gate recomputes every estimated row of benchmarks/published_parallel.py (analytic memory and the
time model, about a second), and fails on estimates perturbed on purpose."""

from __future__ import annotations

import pytest

from _runs import load_benchmark
from trainfit.memory.closed_form import step_peak
from trainfit.perf import fp8_casts

published = load_benchmark("published_parallel")
gate = published.record


def test_the_estimates_hold_the_published_record() -> None:
    recorded = gate.read()
    found = gate.problems(recorded, published.current_errors())
    if found:
        pytest.fail(gate.message(found, recorded))


def test_the_record_says_when_and_why_and_its_medians_are_its_rows() -> None:
    recorded = gate.read()
    assert recorded["recorded"] and recorded["reason"].strip() and recorded["command"] == gate.RECORD_COMMAND
    for metric in gate.METRICS:
        assert recorded[metric] == gate.summary(recorded["rows"], metric)
    assert recorded[gate.FITS] == gate.fit_summary(recorded["rows"])


def _failure(found: list[str]) -> str:
    assert found, "the gate let a perturbed estimate through"
    return gate.message(found, gate.read())


def test_compiled_fp8_casts_priced_as_eager_ones_fail_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory of a compiled step's float8 backward counted with eager's fp32 temporaries: the
    published 405B float8 rows (compiled, full checkpointing) leave their bands."""
    monkeypatch.setattr(step_peak, "FLOAT8_CAST_BYTES_COMPILED", step_peak.FLOAT8_CAST_BYTES)
    message = _failure(gate.problems(gate.read(), published.current_errors()))
    assert "tt-2412 405B 3D FSDP8 TP8 PP8 1F1B: memory error" in message
    assert "throughput" not in message and gate.RECORD_COMMAND in message


def test_compiled_fp8_casts_timed_as_eager_ones_fail_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    eager = fp8_casts.cast_bytes
    monkeypatch.setattr(fp8_casts, "cast_bytes", lambda hp_bytes, *, compiled: eager(hp_bytes, compiled=False))
    message = _failure(gate.problems(gate.read(), published.current_errors()))
    assert "tt-2412 70B 2D FSDP32 TP8: throughput error" in message and ": memory" not in message


def test_the_gate_rules() -> None:
    """Medians may grow by MEDIAN_SLACK points, a row may move ROW_BAND points either way, and the rows
    and figures compared are the recorded ones."""
    rows = {f"row {i}": {"memory": e, "throughput": -e} for i, e in enumerate((-8.0, 3.0, 12.0))}
    recorded = gate.make_record(rows, "the rules' test", "2026-11-27")
    assert gate.problems(recorded, rows) == []
    assert gate.problems(recorded, {**rows, "row 1": {"memory": 4.9, "throughput": -1.1}}) == []
    # every row 1.5 points worse: each within its band, the medians (8.0) not within 1 point
    worse = {name: {m: e + 1.5 * (1 if e > 0 else -1) for m, e in errs.items()} for name, errs in rows.items()}
    assert gate.problems(recorded, worse) == ["memory median |error| 9.50%, recorded 8.00% (slack 1 point)",
                                              "throughput median |error| 9.50%, recorded 8.00% (slack 1 point)"]
    # one row better by 2.5 points: out of its band all the same
    better = {**rows, "row 2": {"memory": 9.5, "throughput": -12.0}}
    assert gate.problems(recorded, better) == ["row 2: memory error +9.50%, recorded +12.00% (band +-2 points)"]
    moved = {"row 0": rows["row 0"], "row 1": {"memory": 3.0}, "row 3": {"memory": 1.0}}
    assert gate.problems(recorded, moved) == ["row 2: recorded, no longer estimated", "row 3: estimated, not in the "
                                              "record", "row 1: throughput recorded, no longer compared"]
    with pytest.raises(ValueError, match="needs its reason"):
        gate.make_record(rows, " ", "2026-11-27")


def test_a_fit_call_that_changes_fails_the_gate() -> None:
    """Either way: a run called "does not fit" that was called "fits", and the reverse, are changes to record."""
    rows = {"row 0": {"memory": 1.0, gate.FITS: 1.0}, "row 1": {"throughput": 2.0, gate.FITS: 0.0}}
    recorded = gate.make_record(rows, "the rules' test", "2026-12-04")
    assert recorded[gate.FITS] == {"rows": 2, "called_fits": 1}
    assert gate.problems(recorded, rows) == []
    flipped = {"row 0": {"memory": 1.0, gate.FITS: 0.0}, "row 1": {"throughput": 2.0, gate.FITS: 1.0}}
    assert gate.problems(recorded, flipped) == ["row 0: called 'does not fit', recorded 'fits' (the run ran)",
                                                "row 1: called 'fits', recorded 'does not fit' (the run ran)"]
