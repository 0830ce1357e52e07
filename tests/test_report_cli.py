"""`trainfit estimate --traced`, `trainfit measure` and `trainfit report` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _runs import run_overrides


def trainfit(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture
def small(tmp_path: Path) -> list[str]:
    return run_overrides(tmp_path, "--training.micro_batch_size=8", "--training.seq_len=64",
                         "--training.global_batch_size=8")


def test_traced_estimate_has_the_analytic_schema_plus_a_timeline(small: list[str]) -> None:
    traced = json.loads(trainfit("estimate", *small, "--traced", "--json").stdout)
    analytic = json.loads(trainfit("estimate", *small, "--json").stdout)
    assert set(traced) == set(analytic) | {"timeline"}
    assert len(traced["timeline"]) > 100
    assert traced["per_rank"]["peak"] == max(point[1] for point in traced["timeline"])
    assert abs(traced["per_rank"]["peak"] - analytic["per_rank"]["peak"]) < 0.1 * analytic["per_rank"]["peak"]
    on_h100 = [*small, "--hardware.gpu=H100-SXM-80GB", "--hardware.memory_gib=0.5", "--json"]
    traced = json.loads(trainfit("estimate", *on_h100, "--traced").stdout)["per_rank"]
    analytic = json.loads(trainfit("estimate", *on_h100).stdout)["per_rank"]
    # the CUDA context and NCCL's buffers (none on one rank), which tracing cannot see, are the analytic's;
    # the caching allocator's fragmentation is the trace's own replay (memory/traced/caching_allocator.py)
    terms, analytic_terms = traced["margin_terms"], analytic["margin_terms"]
    assert set(terms) == set(analytic_terms) == {"cuda_context", "allocator_fragmentation", "comm_buffers"}
    assert terms["cuda_context"] == analytic_terms["cuda_context"] > 0 and terms["comm_buffers"] == 0
    assert 0 <= terms["allocator_fragmentation"] < traced["peak"]
    assert traced["reserved_margin"] == sum(terms.values())
    # torch.cuda.max_memory_reserved as the replayed allocator reaches it: at least the tensors' peak
    assert traced["reserved_peak"] >= traced["peak"] and analytic["reserved_peak"] is None
    assert traced["fits"] == (traced["peak"] + traced["reserved_margin"] <= traced["device_memory"])


def test_measure_json_compares_with_the_estimate(small: list[str]) -> None:
    measured = json.loads(trainfit("measure", *small, "--json").stdout)
    analytic = json.loads(trainfit("estimate", *small, "--json").stdout)
    assert {"model", "per_rank", "per_stage"} <= set(measured)
    assert measured["model"]["num_params"] == analytic["model"]["num_params"]
    peak = measured["per_rank"]["peak"]
    assert abs(analytic["per_rank"]["peak"] - peak) < 0.1 * peak
    # the tensors' peak is the sum of the components; what the allocator held beyond them is named apart
    components = ("params", "master_params", "grads", "optimizer", "activations", "logits", "buffers")
    assert sum(measured["per_rank"][name] for name in components) == peak
    assert 0 <= measured["per_rank"]["non_tensor"] < peak
    # CUDA's reserved peak and the device's used bytes: none on the CPU, and said so (null)
    assert measured["per_rank"]["reserved_peak"] is None and measured["per_rank"]["device_used"] is None


def test_report_prints_errors_and_draws_both_pictures(small: list[str], tmp_path: Path) -> None:
    out = trainfit("report", *small, "--plot", str(tmp_path / "report.png")).stdout
    assert "analytic" in out and "traced" in out and "error" in out and "peak phase" in out and "non_tensor" in out
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
