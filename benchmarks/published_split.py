"""The published throughput rows split into a fitting half and a held-out half, fixed before any
figure of the GPU time model is fitted to them (published_split.json beside this file).

Why a fixed split: the GPU time model (issue: GPU truth) may take efficiencies from published runs.
Its error on the rows it was fitted to says little; its error on rows it never saw says how it does on
a user's run. The held-out half is chosen here, by a rule that looks at no error, and is never moved.

The unit of the split is a group, not a row: the rows that run one model on one device type and count
(the layouts of one (model, GPU count) comparison, and the same configuration published twice, as
torchtitan's benchmark file and its paper do). A group is held out whole, so no held-out layout has a
near-twin in the fitting half, and the held-out half keeps whole groups for the rank correlation
within each (model, GPU count) group that the validation reports.

The rule (RULE) looks at no error: groups in the order of the sha256 of their key, each to the half
with fewer rows so far. New rows join their group's half; a new group goes to the half with fewer
rows. `--assign` adds the rows the file lacks and never moves one; the suite checks the file against
the rows (tests/estimator/test_published_split.py).

    PYTHONPATH=src python benchmarks/published_split.py            # each half: rows, groups, sources,
                                                                   # median |error|, rank correlations
    PYTHONPATH=src python benchmarks/published_split.py --assign   # add new rows to the file
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_parallel as published  # noqa: E402 (beside this script)

SPLIT = Path(__file__).with_name("published_split.json")
HALVES = ("fit", "held_out")


def group_key(row: published.Published) -> str:
    """The row's group: its model shape, device and GPU count, as text (what the hash reads)."""
    cfg = published.build_config(row)
    m, h = cfg.model, cfg.hardware
    shape = (f"dim={m.dim} layers={m.num_layers} heads={m.num_heads} kv={m.num_kv_heads} ffn={m.ffn_dim} "
             f"vocab={m.vocab_size} experts={m.num_experts}x{m.expert_ffn_dim}/{m.experts_per_token}")
    return f"{shape} gpu={h.gpu} gpus={h.num_gpus}"


RULE = ("a group is the rows of one model shape (dim, layers, heads, kv heads, ffn, vocab, experts), device and "
        "GPU count; groups in the order of sha256(key), each to the half with fewer rows so far (fit on a tie); "
        "a group's rows stay in one half; a new group goes to the half with fewer rows; no row ever moves")


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def throughput_rows() -> list[published.Published]:
    """Every estimated row with a published throughput: what the split covers."""
    return [row for row in published.CONFIGS if row.overrides and row.throughput is not None]


def read() -> dict:
    return json.loads(SPLIT.read_text())


def assigned(split: dict) -> dict[str, str]:
    """Row name -> half, as the file holds it."""
    return {name: half for half in HALVES for name in split[half]}


def assign(split: dict) -> tuple[dict, list[str]]:
    """`split` with the rows it lacks added: each to its group's half (a group already in the file
    keeps its half), a new group's to the rule's. Returns the new split and the rows added."""
    have = assigned(split)
    groups: dict[str, str] = {}
    rows = throughput_rows()
    keys = {row.name: group_key(row) for row in rows}
    for row in rows:
        if row.name in have:
            groups.setdefault(keys[row.name], have[row.name])
    out = {**split, **{half: list(split[half]) for half in HALVES}}
    new = sorted({keys[row.name] for row in rows if row.name not in have}, key=lambda k: (k in groups, _hash(k)))
    added = []
    for key in new:
        if key not in groups:
            groups[key] = min(HALVES, key=lambda half: (len(out[half]), HALVES.index(half)))
        names = [row.name for row in rows if keys[row.name] == key and row.name not in have]
        out[groups[key]].extend(names)
        added.extend(names)
    return out, added


def problems(split: dict) -> list[str]:
    """What is wrong with the file against the rows: a row in neither or both halves, a name that is
    no row, a group split across the halves."""
    found = []
    names = [name for half in HALVES for name in split[half]]
    for name, n in Counter(names).items():
        if n > 1:
            found.append(f"{name!r} is listed {n} times")
    rows = {row.name: row for row in throughput_rows()}
    for name in sorted(set(names) - set(rows)):
        found.append(f"{name!r} is no estimated throughput row of published_parallel.py")
    for name in sorted(set(rows) - set(names)):
        found.append(f"{name!r} has no half: run `PYTHONPATH=src python benchmarks/published_split.py --assign`")
    have = assigned(split)
    halves_of_group: dict[str, set[str]] = {}
    for name in set(rows) & set(have):
        halves_of_group.setdefault(group_key(rows[name]), set()).add(have[name])
    for key, halves in sorted(halves_of_group.items()):
        if len(halves) > 1:
            found.append(f"group {key!r} has rows in both halves")
    return found


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 0, ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's of the ranks); None when a side has no spread."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else None


def half_report(names: list[str]) -> str:
    """A half's throughput median |error|, rows within 10%, and the rank correlation of predicted with
    published throughput within each group of >= 3 rows in one unit (the layouts of one comparison)."""
    rows = {row.name: row for row in throughput_rows()}
    results = [published.predict(rows[n]) for n in names]
    errors = sorted(abs(r.throughput_error()) for r in results)
    median = statistics.median(errors)
    text = f"median |error| {median:.1%}, {sum(e <= published.GAP for e in errors)} of {len(errors)} within 10%"
    by_group: dict[tuple[str, str], list] = {}
    for r in results:
        by_group.setdefault((group_key(r.row), r.row.metric), []).append(r)
    correlations = []
    for (key, metric), group in sorted(by_group.items()):
        if len(group) >= 3:
            rho = spearman([r.throughput for r in group], [r.row.throughput for r in group])
            if rho is not None:
                correlations.append(f"{rho:+.2f} ({len(group)} rows: {key}, {metric})")
    return text + "".join(f"\n    rank correlation {c}" for c in correlations)


def markdown_summary(split: dict) -> str:
    """README's GPU accuracy table: per source, each half's rows, median |throughput error| and its
    worst row, predicted against published."""
    rows = {row.name: row for row in throughput_rows()}
    half_of = assigned(split)
    by_source: dict[str, dict[str, list[float]]] = {}
    for name, row in rows.items():
        error = published.predict(row).throughput_error()
        by_source.setdefault(row.source, {h: [] for h in HALVES})[half_of[name]].append(100 * error)

    def cell(errors: list[float]) -> str:
        if not errors:
            return "-"
        worst = max(errors, key=abs)
        return f"{len(errors)}: {statistics.median(abs(e) for e in errors):.0f}% (worst {worst:+.0f}%)"

    lines = ["| source | fitting half: rows: median abs error (worst) | held-out half |", "| --- | --- | --- |"]
    for source, halves in sorted(by_source.items()):
        label = published.SOURCES[source].short if source in published.SOURCES else source
        lines.append(f"| {label} | {cell(halves['fit'])} | {cell(halves['held_out'])} |")
    every = {h: [e for halves in by_source.values() for e in halves[h]] for h in HALVES}
    lines.append(f"| all | {cell(every['fit'])} | {cell(every['held_out'])} |")
    return "\n".join(lines)


FIT_RULE_SCAN = [round(0.40 + 0.02 * i, 2) for i in range(31)]
"""The Grand Teton kernel shares the fitting rule scans (0.40 to 1.00 by 0.02)."""


def fit_grand_teton(split: dict) -> list[tuple[float, float, float]]:
    """The one figure fitted to published runs (published_parallel.GRAND_TETON_EFFICIENCY), by its
    rule, fixed before the first fit: the share of the H100 SXM's kernel rates that zeroes the median
    signed throughput error of the fitting half's torchtitan rows (the hosts that share is about).
    Returns (share, median signed error, median |error|) over FIT_RULE_SCAN, best first."""
    rows = {row.name: row for row in throughput_rows()}
    ours = [rows[n] for n in split["fit"] if rows[n].overrides and published.GRAND_TETON_EFFICIENCY_FLAG
            in " ".join(rows[n].overrides)]
    scanned = []
    for share in FIT_RULE_SCAN:
        errors = []
        for row in ours:
            overrides = tuple(o if not o.startswith(published.GRAND_TETON_EFFICIENCY_FLAG)
                              else f"{published.GRAND_TETON_EFFICIENCY_FLAG}={share}" for o in row.overrides)
            errors.append(published.predict(dataclasses.replace(row, overrides=overrides)).throughput_error())
        scanned.append((share, statistics.median(errors), statistics.median(abs(e) for e in errors)))
    return sorted(scanned, key=lambda x: abs(x[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assign", action="store_true", help="add the rows the file lacks (never moves one)")
    parser.add_argument("--markdown", action="store_true", help="print README's GPU accuracy table and exit")
    parser.add_argument("--fit-grand-teton", action="store_true", help="apply the fitting rule of the one fitted "
                        "figure (Grand Teton's kernel share) to the fitting half and print the scan, best first")
    args = parser.parse_args()
    split = read() if SPLIT.exists() else {"rule": RULE, **{half: [] for half in HALVES}}
    if args.markdown:
        print(markdown_summary(split))
        return
    if args.fit_grand_teton:
        for share, signed, absolute in fit_grand_teton(split)[:5]:
            print(f"share {share:.2f}: fitting half's torchtitan rows median signed error {signed:+.1%}, "
                  f"median |error| {absolute:.1%}")
        return
    if args.assign:
        split, added = assign(split)
        SPLIT.write_text(json.dumps(split, indent=1) + "\n")
        print(f"{len(added)} rows added to {SPLIT.name}")
    found = problems(split)
    rows = {row.name: row for row in throughput_rows()}
    for half in HALVES:
        names = [n for n in split[half] if n in rows]
        groups = {group_key(rows[n]) for n in names}
        sources = Counter(rows[n].source for n in names)
        print(f"{half}: {len(names)} rows in {len(groups)} groups; by source: "
              + ", ".join(f"{s} {n}" for s, n in sorted(sources.items())))
        print(f"  throughput: {half_report(names)}")
    for problem in found:
        print(f"problem: {problem}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
