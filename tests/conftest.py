"""Shared fixtures: isolated cache and run folders, restored global torch state; every test's fp8
GEMM work counted and held to a budget (tests/_fp8_flops.py).

Every test process computes on one thread (OMP_NUM_THREADS=1, set before torch is imported and
inherited by the processes tests start): the models are tiny, and on a machine whose cores are
busy, idle OpenMP workers spin-wait for their share of each operator, which made steps 2-5x slower
and distributed tests' ranks (2-4 processes on 2 cores) slower still."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402

from _fp8_flops import (  # noqa: E402, F401  (the fp8 budget's hooks; torch: after OMP_NUM_THREADS)
    pytest_configure,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist (pyproject.toml's `-n 2`) sends each scope to one worker, whole: tests/distributed
    is one scope (its files share session fixtures: the torchrun runs they resume, the one-process
    reference runs), every other file is its own (its module fixtures, such as the accuracy grid's
    measured worlds, computed once). xdist's own `xdist_group` marks are not used: under pytest 9.2
    its loadgroup mode no longer sees them."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/distributed" if path.startswith("tests/distributed/") else path

    return ByFile(config, log)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared datasets go to a per-session cache, never to the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _restore_torch_state() -> None:
    import torch

    dtype, rng, threads = torch.get_default_dtype(), torch.get_rng_state(), torch.get_num_threads()
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(rng)
    torch.set_num_threads(threads)
