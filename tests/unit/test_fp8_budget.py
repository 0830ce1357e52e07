"""The fp8 GEMM budget of the tests (tests/_fp8_flops.py, applied to every test by tests/conftest.py):
the counter sees every GEMM of a float8 linear and none run on fake tensors, a rank process reports
its own, and a test over the budget fails, naming its FLOPs, the budget and the time it would take."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

from _fp8_flops import BUDGET_ENV, RANKS_DIR_ENV, REPORT_ENV, ScaledMMCounter, counted_rank, ranks_flops
from trainfit.fp8_matmul import fp8_matmul

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_counter_sees_every_gemm_of_a_float8_linear_and_none_on_fake_tensors(scaling: str) -> None:
    counter = ScaledMMCounter().install()
    try:
        linear = Float8Linear.from_float(nn.Linear(64, 32, bias=False),
                                         config=Float8LinearConfig.from_recipe_name(scaling))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = linear(torch.randn(48, 64, requires_grad=True))
        out.sum().backward()
        assert counter.flops == 3 * 2 * 48 * 64 * 32  # forward, input gradient, weight gradient
        with FakeTensorMode():
            fp8_matmul(64, 64, 64, "cpu")()
        assert counter.flops == 3 * 2 * 48 * 64 * 32
    finally:
        counter.uninstall()


def test_a_rank_process_writes_its_own_fp8_flops_for_the_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANKS_DIR_ENV, str(tmp_path))
    with counted_rank():
        fp8_matmul(64, 64, 64, "cpu")()
    assert ranks_flops(tmp_path) == 2 * 64**3


def test_a_test_over_the_budget_fails_naming_its_fp8_work(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text("from _fp8_flops import (pytest_configure, pytest_runtest_call,  # noqa\n"
                                         "    pytest_runtest_setup, pytest_runtest_teardown, pytest_sessionfinish,\n"
                                         "    pytest_unconfigure)\n")
    (project / "test_work.py").write_text(textwrap.dedent("""
        from trainfit.fp8_matmul import fp8_matmul

        def test_within():
            fp8_matmul(64, 64, 64, "cpu")()

        def test_over():
            for _ in range(3):
                fp8_matmul(64, 64, 64, "cpu")()

        def test_none():
            pass
        """))
    report = tmp_path / "report.tsv"
    src = TESTS.parent / "src"
    env = {**os.environ, BUDGET_ENV: "1e6", REPORT_ENV: str(report),
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(src), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(project)],
                          cwd=project, env=env, capture_output=True, text=True)
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout + proc.stderr
    flops = 3 * 2 * 64**3
    assert (f"test_work.py::test_over: {flops / 1e9:.3g} GFLOP of fp8 matmuls (torch._scaled_mm), over the budget "
            f"of 0.001 GFLOP per test (tests/_fp8_flops.BUDGET_FLOPS): 0 s at 0.04 GFLOP/s, 0 s at 0.05 GFLOP/s "
            "on a CPU without fp8 hardware. Use fewer steps") in proc.stdout
    lines = report.read_text().splitlines()
    assert lines[0].startswith("test\tfp8 GFLOP\ts at 0.04 GFLOP/s")
    assert [line.split("\t")[0] for line in lines[1:]] == ["test_work.py::test_over", "test_work.py::test_within",
                                                           "total (2 tests)"]
