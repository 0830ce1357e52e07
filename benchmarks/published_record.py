"""The published record as a gate: the errors of benchmarks/published_parallel.py's estimates against
published runs, recorded in published_record.json beside this file, which
tests/estimator/test_published_record.py holds every change of the estimators to.

An error is the estimate over the published figure, less 1, in percentage points (signed). The record
keeps every estimated row's memory and throughput errors (where the row compares them), the median
|error| and the counts of each, whether the estimate calls the row's run one that fits its device (`fits`:
each ran), and the date and the reason of its last re-record. A change fails the gate when:
- the memory or the throughput median |error| grows by more than MEDIAN_SLACK points;
- any row's error leaves its band: its recorded error +- ROW_BAND points (either way: a row that moves
  more, better or worse, is a change of the model to say and record);
- a row, or a row's memory or throughput figure, appears or disappears;
- a row's fit call changes (either way, as a band).

A deliberate change is re-recorded with its reason (RECORD_COMMAND), which prints what moved first.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RECORD = Path(__file__).with_name("published_record.json")
RECORD_COMMAND = 'PYTHONPATH=src python benchmarks/published_parallel.py --record "REASON"'
METRICS = ("memory", "throughput")
MEDIAN_SLACK = 1.0
"""Points the memory or throughput median |error| may grow over the recorded one."""
ROW_BAND = 2.0
"""Points a row's signed error may move from the recorded one, either way."""
WITHIN = 10.0
"""The counts of rows within this many points (published_parallel.GAP)."""
DIGITS = 2
"""Errors are recorded to 0.01 points."""

FITS = "fits"
"""A row's fit call: whether the estimate says its run fits the device (each published run ran)."""
Errors = dict[str, dict[str, float]]
"""Row name -> metric -> signed error in points, for the metrics the row compares; FITS -> 1.0 when the
estimate calls the run one that fits, 0.0 when not."""


def summary(errors: Errors, metric: str) -> dict[str, float]:
    """The rows comparing `metric`, their median |error| and how many are within WITHIN points."""
    values = [abs(e[metric]) for e in errors.values() if metric in e]
    return {"rows": len(values), "median_abs_error": round(statistics.median(values), DIGITS) if values else 0.0,
            "within_10": sum(v <= WITHIN for v in values)}


def fit_summary(errors: Errors) -> dict[str, int]:
    """The rows with a fit call and how many of them are called "fits"."""
    calls = [e[FITS] for e in errors.values() if FITS in e]
    return {"rows": len(calls), "called_fits": int(sum(calls))}


def make_record(errors: Errors, reason: str, day: str) -> dict:
    """The record of `errors` (rows in their order), re-recorded on `day` for `reason`."""
    if not reason.strip():
        raise ValueError("a re-record needs its reason: --record \"what changed and why\"")
    rows = {name: {m: round(e[m], DIGITS) for m in (*METRICS, FITS) if m in e} for name, e in errors.items()}
    # The medians of the rows as recorded (rounded), so that the record agrees with itself.
    return {"recorded": day, "reason": reason, "command": RECORD_COMMAND,
            **{metric: summary(rows, metric) for metric in METRICS}, FITS: fit_summary(rows), "rows": rows}


def read(path: Path = RECORD) -> dict:
    return json.loads(path.read_text())


def write(record: dict, path: Path = RECORD) -> None:
    """JSON with one line per row, so that a re-record's diff shows the rows that moved."""
    head = json.dumps({key: value for key, value in record.items() if key != "rows"}, indent=1)
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(e)}" for name, e in record["rows"].items())
    path.write_text(f'{head[:-2]},\n "rows": {{\n{rows}\n }}\n}}\n')


def problems(record: dict, errors: Errors) -> list[str]:
    """What breaks the gate (module docstring): one line per median, row or figure, empty when none."""
    found = []
    recorded: Errors = record["rows"]
    found += [f"{name}: recorded, no longer estimated" for name in recorded if name not in errors]
    found += [f"{name}: estimated, not in the record" for name in errors if name not in recorded]
    for name, now in errors.items():
        was = recorded.get(name)
        if was is None:
            continue
        for metric in METRICS:
            if (metric in now) != (metric in was):
                change = "compared, not recorded" if metric in now else "recorded, no longer compared"
                found.append(f"{name}: {metric} {change}")
            elif metric in now and abs(now[metric] - was[metric]) > ROW_BAND:
                found.append(f"{name}: {metric} error {now[metric]:+.2f}%, recorded {was[metric]:+.2f}% "
                             f"(band +-{ROW_BAND:g} points)")
        if FITS in now and FITS in was and now[FITS] != was[FITS]:
            said = {1.0: "fits", 0.0: "does not fit"}
            found.append(f"{name}: called {said[now[FITS]]!r}, recorded {said[was[FITS]]!r} (the run ran)")
    for metric in METRICS:
        now, was = summary(errors, metric)["median_abs_error"], record[metric]["median_abs_error"]
        if now > was + MEDIAN_SLACK:
            found.append(f"{metric} median |error| {now:.2f}%, recorded {was:.2f}% (slack {MEDIAN_SLACK:g} point)")
    return found


def message(found: list[str], record: dict) -> str:
    """The gate's failure: what moved, the record's date and reason, and how to re-record a deliberate change."""
    return (f"{len(found)} change(s) against the published record of {record['recorded']} "
            f"({record['reason']}):\n  " + "\n  ".join(found)
            + f"\nIf deliberate, re-record with the reason: {RECORD_COMMAND}")


def markdown(record: dict) -> str:
    """The record's summary as a Markdown table (the documentation's accuracy page prints it)."""
    lines = ["| published figure | runs | median abs error | within 10 points |", "| --- | ---: | ---: | ---: |"]
    for metric in METRICS:
        s = record[metric]
        lines.append(f"| {metric} | {s['rows']} | {s['median_abs_error']:.2f}% | {s['within_10']} |")
    fits = record.get(FITS)
    called = f"\n\nRuns called \"fits\" (each ran): {fits['called_fits']} of {fits['rows']}." if fits else ""
    return "\n".join(lines) + called + f"\n\nRecorded {record['recorded']}: {record['reason']}.\n"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the record's summary as a Markdown table")
    if parser.parse_args().markdown:
        print(markdown(read()))
