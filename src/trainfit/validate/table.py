"""How `trainfit validate`'s entries read: one line each as they finish (its note on a line of its
own), a rich table at the end. Peaks are in the unit that suits the device (GiB on a GPU, MiB on the
CPU's debug models), named in the header."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from trainfit.units import GIB, MIB, fmt_seconds

COLUMNS = ("point", "status", "s", "analytic", "traced", "allocated", "reserved", "err a", "err t",
           "time pred", "time meas", "err time")
WIDTHS = (30, 8, 6, 9, 9, 9, 9, 7, 7, 10, 10, 8)
RIGHT = set(COLUMNS[2:])


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None where either is missing or measured is 0."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def errors(entry: dict[str, Any]) -> dict[str, float | None]:
    """The point's errors against what was measured: each peak against the allocated peak, the step time
    against the median timed step."""
    p, m = entry.get("predicted", {}), entry.get("measured", {})
    return {"analytic_peak": relative_error(p.get("analytic_peak_bytes"), m.get("allocated_peak_bytes")),
            "traced_peak": relative_error(p.get("traced_peak_bytes"), m.get("allocated_peak_bytes")),
            "step_time": relative_error(p.get("step_time_s"), m.get("step_time_s")),
            # the caching allocator's reserved peak (CUDA only): the tensors' peak plus the fragmentation predicted
            "analytic_reserved": relative_error(p.get("analytic_reserved_bytes"), m.get("reserved_peak_bytes")),
            "traced_reserved": relative_error(p.get("traced_reserved_bytes"), m.get("reserved_peak_bytes"))}


def unit_of(device: str) -> tuple[str, int]:
    return ("GiB", GIB) if device == "cuda" else ("MiB", MIB)


def _pct(value: float | None) -> str:
    return f"{value:+.1%}" if value is not None else ""


def _secs(value: float | None) -> str:
    return fmt_seconds(value) if value is not None else ""


def cells(name: str, entry: dict[str, Any], device: str) -> list[str]:
    """The entry's cells, in COLUMNS' order."""
    p, m, e = entry.get("predicted", {}), entry.get("measured", {}), entry.get("errors", {})
    scale = unit_of(device)[1]

    def size(value: int | None) -> str:
        return f"{value / scale:,.2f}" if value is not None else ""

    return [name, entry["status"], f"{entry.get('seconds', 0):.1f}", size(p.get("analytic_peak_bytes")),
            size(p.get("traced_peak_bytes")), size(m.get("allocated_peak_bytes")), size(m.get("reserved_peak_bytes")),
            _pct(e.get("analytic_peak")), _pct(e.get("traced_peak")), _secs(p.get("step_time_s")),
            _secs(m.get("step_time_s")), _pct(e.get("step_time"))]


def note(entry: dict[str, Any]) -> str:
    """Why it was skipped, how it failed, or what a command found."""
    return entry.get("reason") or entry.get("error_line") or entry.get("summary") or entry.get("caveat", "")


def line(values: list[str]) -> str:
    """One fixed-width line of cells (the progress as points finish)."""
    parts = [v.rjust(w) if c in RIGHT else v.ljust(w) for c, v, w in zip(COLUMNS, values, WIDTHS, strict=True)]
    return " ".join(parts).rstrip()


def summary_table(report: dict[str, Any]) -> Table:
    """Every entry of the report: predicted against measured, with the errors in %."""
    device = report["device"]
    table = Table(title=f"trainfit validate on {report['device_name']} ({device}): predicted vs measured, peaks in "
                  f"{unit_of(device)[0]}", caption="err: (predicted - measured) / measured; peaks against the "
                  "allocated peak")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("point", "status") else "right",
                         no_wrap=column == "point")
    for name, entry in report["points"].items():
        table.add_row(*cells(name, entry, device))
    return table
