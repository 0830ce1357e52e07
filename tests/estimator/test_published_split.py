"""The published throughput rows' fitting and held-out halves (benchmarks/published_split.py says
why and how): every estimated throughput row is in exactly one half, a group's rows in one half, and
assigning again adds and moves nothing: a row, once held out, stays held out."""

from __future__ import annotations

from _runs import load_benchmark

split = load_benchmark("published_split")


def _groups(names: list[str]) -> dict[str, list[str]]:
    rows = {row.name: row for row in split.throughput_rows()}
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(split.group_key(rows[name]), []).append(name)
    return out


def test_every_throughput_row_has_one_half_and_groups_stay_whole() -> None:
    found = split.problems(split.read())
    assert not found, "\n".join(found)


def test_assigning_again_moves_no_row() -> None:
    recorded = split.read()
    again, added = split.assign(recorded)
    assert added == []
    assert all(again[half] == recorded[half] for half in split.HALVES)


def test_a_missing_row_rejoins_its_groups_half_and_a_split_group_is_named() -> None:
    recorded = split.read()
    group = next(names for names in _groups(recorded["held_out"]).values() if len(names) > 1)
    lacking = {**recorded, "held_out": [n for n in recorded["held_out"] if n != group[0]]}
    assert any(repr(group[0]) in p and "no half" in p for p in split.problems(lacking))
    again, added = split.assign(lacking)
    assert added == [group[0]] and group[0] in again["held_out"]
    torn = {**lacking, "fit": [*recorded["fit"], group[0]]}
    assert any("both halves" in p for p in split.problems(torn))


def test_a_new_group_goes_to_the_half_with_fewer_rows() -> None:
    recorded = split.read()
    key, names = next(iter(_groups(recorded["fit"]).items()))
    without = {**recorded, "fit": [n for n in recorded["fit"] if n not in names]}
    smaller = min(split.HALVES, key=lambda half: (len(without[half]), split.HALVES.index(half)))
    again, added = split.assign(without)
    assert sorted(added) == sorted(names) and set(names) <= set(again[smaller])
