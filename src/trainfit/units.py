"""Bytes and seconds as people read them. Bytes are ints everywhere else; units appear only when
printed, through these."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


def fmt_bytes(n: float) -> str:
    if abs(n) >= GIB:
        return f"{n / GIB:,.2f} GiB"
    return f"{n / MIB:,.1f} MiB"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"
