"""benchmarks/gpu_check.py runs on the CPU as it will on a GPU machine: checks in their own processes,
a JSON of the machine, the code and each check; CUDA-only checks and checks past the budget skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def gpu_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    return proc, json.loads((out / "gpu_check.json").read_text())


def test_cpu_checks_run_and_cuda_only_ones_are_skipped(tmp_path: Path) -> None:
    proc, report = gpu_check(tmp_path, "--only", "sdpa,resume_rng,measure_snapshot")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["device"] == "cpu"
    assert {"torch", "cuda", "nvidia_smi"} <= set(report["machine"])
    assert {"commit", "src_sha256"} <= set(report["trainfit"])
    checks = report["checks"]
    assert list(checks) == ["sdpa", "resume_rng", "measure_snapshot"]
    assert checks["sdpa"]["status"] == "ok", checks["sdpa"]
    assert checks["sdpa"]["figures"]["math_runs"] is True
    assert checks["sdpa"]["figures"]["efficient_runs"] is False  # a CUDA kernel: its error is recorded
    assert checks["resume_rng"]["status"] == "ok", checks["resume_rng"]
    assert checks["resume_rng"]["figures"]["torch_rng_restored"] is True
    assert checks["measure_snapshot"]["status"] == "skipped: needs CUDA"
    assert all(isinstance(check["seconds"], float) for check in checks.values())
    assert "resume_rng" in proc.stdout and "skipped: needs CUDA" in proc.stdout  # the table
    assert not (tmp_path / "work").exists()  # scratch runs removed; logs kept
    assert (tmp_path / "logs" / "sdpa.log").is_file()


def test_a_check_longer_than_the_time_left_is_skipped(tmp_path: Path) -> None:
    proc, report = gpu_check(tmp_path, "--only", "fp8", "--budget-s", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["checks"]["fp8"]["status"] == "skipped: budget"
