"""`torchrun --nproc_per_node 2 -m trainfit train --profile=STEPS`: every rank writes its trace, and
each summary shows the collectives that one process (tests/integration/test_profiled_run.py) has none of."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _dist import ZERO3_PROFILED_STEP
from trainfit.perf.trace import load_profiles


def test_every_rank_traces_its_collectives(zero3_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, proc = zero3_run
    folder = run_dir / "logs" / "profile"
    assert sorted(p.name for p in folder.glob("*.pt.trace.json")) == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    assert " ".join(proc.stderr.split()).count("summary: trainfit report --profile") == 1  # rank 0 alone says
    profiles = load_profiles(folder)
    assert [(p.rank, p.world_size, p.steps) for p in profiles] == [(r, 2, [ZERO3_PROFILED_STEP]) for r in (0, 1)]
    for p in profiles:
        assert p.compute_us > 0 and p.comm_us > 0 and 0 < p.exposed_comm_us <= p.comm_us
        assert p.compute_us + p.exposed_comm_us + p.idle_us == pytest.approx(p.wall_us)
        ops = {op.name for op in p.ops}
        assert {"gloo:all_gather", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= ops  # FSDP2's


def test_report_shows_both_ranks(zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path) -> None:
    folder = zero3_run[0] / "logs" / "profile"
    png = tmp_path / "timeline.png"
    proc = subprocess.run([sys.executable, "-m", "trainfit", "report", "--profile", str(folder), "--plot", str(png)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│") and "%" in line]
    assert [row.split("│")[1].strip() for row in rows[:2]] == ["0", "1"]
    assert "gloo:all_gather" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
