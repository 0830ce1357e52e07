"""The fp8 GEMM work of each test: every FLOP that goes through torch._scaled_mm, counted, and a
budget per test (tests/conftest.py applies it).

Why count: a CPU without native fp8 matmuls runs torch._scaled_mm on a reference kernel some 1000x
slower than bf16 (benchmarks/README.md, "fp8 GEMM work of the tests", has the rates measured), so
a test that does a few GFLOP of fp8 takes minutes there and seconds here. FLOPs are the same on
every machine; times are not, and no test times anything.

What is counted: 2 x m x k x n per call of torch._scaled_mm on real tensors (torchao's float8
linears, trainfit.fp8_matmul's probe and `trainfit calibrate` call it so; fake tensors, which the
traced estimator runs, cost nothing). In the pytest process the counter is installed once per
session (the hooks at the end, which tests/conftest.py imports); a test's count runs from the start
of its setup (module fixtures included) to the end of its body, when a test over BUDGET_FLOPS
fails. The processes a test starts as ranks (tests/_ranks.py, tests/_dist.GlooTestCase) count their
own and write the total to the test's folder (RANKS_DIR_ENV) as they finish. Processes a test runs
as commands (`python -m trainfit`, torchrun) are not counted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

BUDGET_FLOPS = 2e9
"""The most fp8 GEMM FLOPs one test (its setup, module fixtures included, and its body) may do."""
BUDGET_ENV = "TRAINFIT_FP8_BUDGET_FLOPS"
"""Overrides BUDGET_FLOPS (the budget's own test sets a small one)."""
REFERENCE_FLOPS_PER_S = (0.04e9, 0.05e9)
"""The rates the report predicts each test's time at: torch._scaled_mm's on a CPU without fp8
hardware (benchmarks/README.md)."""
RANKS_DIR_ENV = "TRAINFIT_TEST_FP8_FLOPS_DIR"
"""Set while a test runs: the folder where the rank processes it starts write their fp8 FLOPs."""
REPORT_ENV = "TRAINFIT_FP8_FLOPS_REPORT"
"""A file path: at the session's end, write there every test's fp8 FLOPs (tab-separated)."""
EMULATE_ENV = "TRAINFIT_FP8_EMULATE_FLOPS_PER_S"
"""A rate (e.g. 0.04e9): every counted torch._scaled_mm call lasts at least its FLOPs at that rate (the
counter sleeps the rest), so that a fast machine runs the tests as a CPU with a reference kernel would."""


class ScaledMMCounter:
    """Counts the FLOPs of torch._scaled_mm while installed (it replaces the attribute torchao and
    trainfit look up at each call)."""

    def __init__(self) -> None:
        self.flops = 0
        self._real: Callable[..., torch.Tensor] | None = None

    def install(self) -> ScaledMMCounter:
        real = self._real = torch._scaled_mm
        emulated_rate = float(os.environ.get(EMULATE_ENV, 0))

        def counted(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if is_fake(a) or a.device.type == "meta":
                return real(a, b, *args, **kwargs)
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.flops += flops
            start = time.perf_counter()
            out = real(a, b, *args, **kwargs)
            if emulated_rate:
                time.sleep(max(0.0, flops / emulated_rate - (time.perf_counter() - start)))
            return out

        torch._scaled_mm = counted
        return self

    def uninstall(self) -> None:
        if self._real is not None:
            torch._scaled_mm = self._real
            self._real = None


@contextlib.contextmanager
def counted_rank() -> Iterator[None]:
    """Around a rank process's work: when a test is counting (RANKS_DIR_ENV), count this process's
    fp8 FLOPs and write them to that folder at the end, whatever the outcome."""
    folder = os.environ.get(RANKS_DIR_ENV)
    if not folder:
        yield
        return
    counter = ScaledMMCounter().install()
    try:
        yield
    finally:
        counter.uninstall()
        Path(folder, f"{os.getpid()}.flops").write_text(str(counter.flops))


def ranks_flops(folder: Path) -> int:
    """The FLOPs the rank processes of a test wrote to `folder`."""
    return sum(int(p.read_text() or 0) for p in folder.glob("*.flops"))


def budget_flops() -> float:
    return float(os.environ.get(BUDGET_ENV, BUDGET_FLOPS))


def over_budget_message(test: str, flops: int, budget: float) -> str:
    seconds = ", ".join(f"{flops / rate:,.0f} s at {rate / 1e9:g} GFLOP/s" for rate in REFERENCE_FLOPS_PER_S)
    return (f"{test}: {flops / 1e9:.3g} GFLOP of fp8 matmuls (torch._scaled_mm), over the budget of "
            f"{budget / 1e9:.3g} GFLOP per test (tests/_fp8_flops.BUDGET_FLOPS): {seconds} on a CPU without "
            "fp8 hardware. Use fewer steps, fewer tokens or smaller dims for what the test checks")


def report_lines(flops_per_test: dict[str, int]) -> list[str]:
    """The tests that did fp8 work, most first, and the total, with the time at each reference rate."""
    rates = REFERENCE_FLOPS_PER_S
    header = "test\tfp8 GFLOP\t" + "\t".join(f"s at {r / 1e9:g} GFLOP/s" for r in rates)

    def line(name: str, flops: int) -> str:
        return f"{name}\t{flops / 1e9:.3f}\t" + "\t".join(f"{flops / r:,.1f}" for r in rates)

    rows = sorted(((n, f) for n, f in flops_per_test.items() if f), key=lambda nf: -nf[1])
    return [header, *(line(n, f) for n, f in rows), line(f"total ({len(rows)} tests)", sum(f for _, f in rows))]


# ---------------------------------------------------------------- the pytest hooks (tests/conftest.py imports them)

_START = pytest.StashKey[tuple[int, Path]]()
_counter = ScaledMMCounter()
_flops_per_test: dict[str, int] = {}
"""Each test's fp8 GEMM FLOPs (node id -> FLOPs), its ranks' included."""


def pytest_configure(config: pytest.Config) -> None:
    _counter.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _counter.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """A test's fp8 work counts from the start of its setup (module fixtures included), its ranks' too."""
    folder = Path(tempfile.mkdtemp(prefix="trainfit-fp8-flops-"))
    item.stash[_START] = (_counter.flops, folder)
    os.environ[RANKS_DIR_ENV] = str(folder)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After the test's body: record its fp8 work, and fail the test when that exceeds the budget."""
    result = yield
    start, folder = item.stash[_START]
    flops = _flops_per_test[item.nodeid] = _counter.flops - start + ranks_flops(folder)
    if flops > budget_flops():
        pytest.fail(over_budget_message(item.nodeid, flops, budget_flops()), pytrace=False)
    return result


def pytest_runtest_teardown(item: pytest.Item) -> None:
    os.environ.pop(RANKS_DIR_ENV, None)
    if _START in item.stash:
        shutil.rmtree(item.stash[_START][1], ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """REPORT_ENV=FILE: every test's fp8 FLOPs, written to FILE (benchmarks/fp8_test_budget.py)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text("\n".join(report_lines(_flops_per_test)) + "\n")
