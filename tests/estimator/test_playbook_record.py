"""The Playbook's measured H100 runs as a gate (benchmarks/playbook.py): a change to the estimators or the
time model that ranks the given half's layouts worse, or calls their memory or fit worse, fails here unless
re-recorded on purpose with its reason:

    python benchmarks/playbook.py --record "REASON"

The recomputation estimates all 1,613 runs (a few seconds)."""

from __future__ import annotations

import json

import pytest

from _runs import load_benchmark
from trainfit.perf import timing

playbook = load_benchmark("playbook")

SPEARMAN_SLACK = 0.01
"""Of the median rank correlation: float noise, not a change."""
MEMORY_SLACK = 0.005
"""Of the memory median |error|."""


def _problems(recorded: dict, now: dict) -> list[str]:
    found = []
    if now["median_spearman"] < recorded["median_spearman"] - SPEARMAN_SLACK:
        found.append(f"median Spearman {now['median_spearman']:.3f} < recorded {recorded['median_spearman']:.3f}")
    for key in ("best_in_top_10", "ran_called_fits", "ooms_called_not_fit", "nanotron_refuses_called_not_fit"):
        if now[key] < recorded[key]:
            found.append(f"{key} {now[key]} < recorded {recorded[key]}")
    for key in ("ran", "ooms", "nanotron_refuses"):  # what the calls count: the data's, fixed unless redefined
        if now[key] != recorded[key]:
            found.append(f"{key} {now[key]} != recorded {recorded[key]}")
    if now["memory_median_abs_error"] > recorded["memory_median_abs_error"] + MEMORY_SLACK:
        found.append(f"memory median |error| {now['memory_median_abs_error']:.3f} > recorded "
                     f"{recorded['memory_median_abs_error']:.3f}")
    return found


@pytest.fixture(scope="module")
def recorded() -> dict:
    record = json.loads(playbook.RECORD.read_text())
    assert record["recorded"] and record["reason"].strip()
    return record


def test_the_estimates_hold_the_playbook_record(recorded: dict) -> None:
    found = _problems(recorded, playbook.current())
    assert not found, f"{found}; re-record on purpose: python benchmarks/playbook.py --record 'REASON'"


def test_a_perturbed_time_model_fails_the_gate(recorded: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collectives priced 20x slower scramble the ranking: the gate must see it."""
    original = timing.timed_collectives

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        return [(c, seconds * 20) for c, seconds in original(*args, **kwargs)]

    monkeypatch.setattr(timing, "timed_collectives", slow)
    assert _problems(recorded, playbook.current())


def test_nanotron_refusals_never_ran() -> None:
    """The crashes counted apart as nanotron's 1F1B assertion (grad_acc < pp - 1): no such run of the given half
    ran, and every crash is one of the three kinds exactly once."""
    runs = playbook.read_runs(playbook.DATA)
    refused = [r for r in runs if playbook.nanotron_refuses(r)]
    assert refused and all(r.memory_gib is None for r in refused)
    crashes = [r for r in runs if r.memory_gib is None]
    preds = [playbook.Predicted(r, None) for r in crashes]
    s = playbook.summarize(preds, runs, rank=False)
    assert s.ooms + s.other_crashes + s.engine_refused == len(crashes)
    assert s.engine_refused == sum(not playbook.not_oom(r, runs) for r in refused)
