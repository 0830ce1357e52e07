"""`trainfit validate` in CPU mode, as a user runs it: the same driver, worker and JSON as on a GPU,
on a reduced grid (calibrate, train, a dense and an MoE point, and fp8, which the CPU skips)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ONLY = "calibrate,train,dense-bf16,dense-fp8,moe-bf16-full"


def validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainfit", "validate", *args], capture_output=True, text=True,
                          timeout=300)


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("validate") / "validate.json"
    proc = validate("--device", "cpu", "--out", str(out), "--only", ONLY)
    return proc, json.loads(out.read_text())


def test_cpu_mode_writes_the_machine_the_code_and_every_entry(cpu_run: tuple[subprocess.CompletedProcess, dict]
                                                              ) -> None:
    proc, report = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["device"] == "cpu" and report["finished"] is True
    assert {"torch", "cuda", "python", "nvidia_smi"} <= set(report["machine"])
    assert {"commit", "dirty", "src_sha256"} <= set(report["trainfit"])
    assert list(report["points"]) == ONLY.split(",")
    assert report["total_seconds"] > 0
    for name in ("calibrate", "train"):
        assert report["points"][name]["status"] == "ok", report["points"][name]
    assert finite(report["points"]["calibrate"]["profile"]["matmul_flops_per_s"]["fp32"])
    assert finite(report["points"]["train"]["figures"]["last_loss"])


def test_each_run_point_has_finite_predictions_and_measurements(cpu_run: tuple[subprocess.CompletedProcess, dict]
                                                                ) -> None:
    points = cpu_run[1]["points"]
    for name in ("dense-bf16", "moe-bf16-full"):
        point = points[name]
        assert point["status"] == "ok", point
        assert point["time_basis"] == "calibrate --quick profile"
        p, m = point["predicted"], point["measured"]
        for value in (p["analytic_peak_bytes"], p["traced_peak_bytes"], p["step_time_s"], m["allocated_peak_bytes"],
                      m["tensor_peak_bytes"], m["step_time_s"]):
            assert finite(value), (name, p, m)
        assert m["reserved_peak_bytes"] is None  # the CPU has no caching allocator: nothing reserved to predict
        assert p["analytic_reserved_bytes"] is None and p["traced_reserved_bytes"] is None
        assert point["errors"]["analytic_reserved"] is None and point["errors"]["traced_reserved"] is None
        assert len(m["step_times_s"]) == 3 and m["losses_finite"] is True
        compared = ("analytic_peak", "traced_peak", "step_time")
        assert all(isinstance(point["errors"][k], float) and math.isfinite(point["errors"][k]) for k in compared)
        assert abs(point["errors"]["traced_peak"]) < 0.05  # the debug models' tensors, traced exactly


def test_a_point_the_device_cannot_run_is_skipped_with_its_reason(cpu_run: tuple[subprocess.CompletedProcess, dict]
                                                                  ) -> None:
    proc, report = cpu_run
    fp8 = report["points"]["dense-fp8"]
    assert fp8["status"] == "skipped" and "no fp8 hardware" in fp8["reason"]
    assert finite(fp8["predicted"]["analytic_peak_bytes"])
    assert "dense-fp8: skipped: no fp8 hardware" in proc.stdout
    assert "moe-bf16-full" in proc.stdout and "predicted vs measured" in proc.stdout  # the rows and the table


def test_a_bad_only_name_is_a_named_error_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "v.json"
    proc = validate("--device", "cpu", "--out", str(out), "--only", "dense-bf16,dense-bf17")
    assert proc.returncode == 2
    assert "--only dense-bf17: no such step or grid point; choose from calibrate, train, dense-fp32" in proc.stderr
    assert not out.exists()


def test_an_entry_past_the_budget_is_skipped_and_cuda_without_a_gpu_is_an_error(tmp_path: Path) -> None:
    out = tmp_path / "v.json"
    proc = validate("--device", "cpu", "--out", str(out), "--only", "dense-bf16", "--budget-s", "0.5")
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(out.read_text())["points"]["dense-bf16"]
    assert entry["status"] == "skipped" and entry["reason"].startswith("budget: ")
    if not _cuda_available():
        proc = validate("--device", "cuda", "--out", str(out))
        assert proc.returncode == 2 and "--device cuda: torch sees no GPU here" in proc.stderr


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_point_that_fails_or_overruns_records_why(tmp_path: Path) -> None:
    from trainfit.validate.grid import Point
    from trainfit.validate.run import child_env, run_point

    env = child_env("cpu")
    bad = run_point(Point("bad", "dense", "a preset that does not exist", ("--model.preset=nope",)), env, tmp_path,
                    "cpu", None, limit_s=60)
    assert bad["status"] == "failed" and "model.preset" in bad["error_line"] and "exit code 1" in bad["error"]
    assert bad["errors"] == dict.fromkeys(("analytic_peak", "traced_peak", "step_time", "analytic_reserved",
                                           "traced_reserved"))
    slow = run_point(Point("slow", "dense", "debug", ("--model.preset=debug", "--training.device=cpu")), env,
                     tmp_path, "cpu", None, limit_s=0.5)
    assert slow["status"] == "failed" and slow["error_line"].startswith("timed out after 0.5 s")
