"""benchmarks/gpu_check.py runs on the CPU as it will on a GPU machine: checks in their own processes,
a JSON of the machine, the code and each check; CUDA-only checks and checks past the budget skipped;
the planned GPU seconds fit the default budget."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from _runs import load_benchmark

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


def test_the_planned_gpu_seconds_fit_the_default_budget() -> None:
    """Every check is planned to start within the default budget, after the machine's probe (nvidia-smi, and
    torch imported with a CUDA context in a process of its own: 8 s allowed): a check whose plan no longer
    fits is skipped, and the last one (compile) is the one that would be."""
    driver = load_benchmark("gpu_check")
    probe_s = 8
    assert sum(spec.cuda_s for spec in driver.CHECKS.values()) + probe_s <= driver.BUDGET_S


def test_host_time_collective_latency_and_fsdp_peak_measure_on_the_cpu(tmp_path: Path) -> None:
    """The three checks' figures, sane on the debug-sized CPU runs: positive host seconds per block within
    0.2-10x of perf/host_costs.py's eager figure (measured on the same kind of core, here busy, with autocast
    and the trainer's step on top); gloo latencies of two processes beside perf/comms.py's constants; an FSDP2
    rank of 8 whose measured peak grows with the micro-batch and lies within 20% of the analytic estimate."""
    from trainfit.perf import comms
    from trainfit.perf.host_costs import TRAINFIT

    proc, report = gpu_check(tmp_path, "--only", "host_time,collective_latency,fsdp_peak")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = report["checks"]
    assert all(checks[name]["status"] == "ok" for name in checks), checks

    host = checks["host_time"]["figures"]
    model_block = sum(TRAINFIT.block_s["eager", 1])
    assert math.isclose(host["model_block_s"], model_block, rel_tol=1e-3), host
    assert 0 < host["block_forward_s"] < host["block_s"] <= host["step_block_s"] * 1.5, host
    for measured in ("block_s", "cpu_kernels_block_s"):
        assert 0.2 < host[measured] / model_block < 10, (measured, host)

    latency = checks["collective_latency"]["figures"]
    assert (latency["world_size"], latency["backend"], latency["priced_ranks"]) == (2, "gloo", 2)
    assert math.isclose(latency["model_base_us"], comms.COLLECTIVE_BASE_LATENCY_S * 1e6, rel_tol=1e-3)
    for kind in ("all_gather", "reduce_scatter"):
        for size in ("4KiB", "16KiB", "64KiB", "256KiB", "1MiB"):
            assert latency[f"{kind}_{size}_us"] > 0 and latency[f"{kind}_{size}_streamed_us"] > 0, latency
            assert latency[f"{kind}_{size}_model_us"] > latency["model_base_us"], latency
    assert latency["floor_us"] > 0

    fsdp = checks["fsdp_peak"]["figures"]
    assert (fsdp["world_size"], fsdp["num_layers"]) == (8, 4), fsdp
    peaks = [fsdp[f"mb{mb}_measured_peak_bytes"] for mb in (2, 8)]
    assert 0 < peaks[0] < peaks[1], fsdp
    for mb in (2, 8):
        assert fsdp[f"mb{mb}_shards"] == 8 and fsdp[f"mb{mb}_losses_finite"] is True, fsdp
        assert 0.8 < fsdp[f"mb{mb}_estimated_over_measured_peak"] < 1.2, fsdp


def test_imports_and_gpt_oss_run_on_the_cpu(tmp_path: Path) -> None:
    """The checks the first GPU run called for: every module imports (there torch 2.11 lacked a name one
    imported), and gpt-oss's block trains with falling losses, its measured peak within 25% of the estimate."""
    proc, report = gpu_check(tmp_path, "--only", "imports,gpt_oss")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    imports, gpt_oss = report["checks"]["imports"]["figures"], report["checks"]["gpt_oss"]["figures"]
    assert imports["failed"] == 0 and imports["modules"] > 100
    assert gpt_oss["loss_last"] < gpt_oss["loss_first"] and 0.8 < gpt_oss["estimated_over_measured_peak"] < 1.25
