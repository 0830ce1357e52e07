"""A 2-rank ZeRO-3 run launched as users do (`torchrun ... -m trainfit train`), shared by the tests
of resuming its checkpoints elsewhere: on 1 process, on 4 ranks (HSDP), and exported to HF."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _dist import run_overrides

ZERO3_STEPS = 6
ZERO3_LAYOUT = ("--parallel.zero_stage=3", "--checkpoint.interval=3", "--training.eval_interval=3")
ZERO3_RUN_ENV = "TRAINFIT_TEST_ZERO3_RUN"


def torchrun(nproc: int, *args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node N ARGS` (the torchrun script, as a module; standalone
    picks a free port, so concurrent test sessions do not collide)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           *args], capture_output=True, text=True, env=env, timeout=timeout)


def subprocess_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The session's data cache (tests/conftest.py), for processes a session fixture starts."""
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.getbasetemp() / "cache"), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("zero3_cli")
    proc = torchrun(2, "-m", "trainfit", "train", *run_overrides(run_dir, f"--training.steps={ZERO3_STEPS}",
                                                                  *ZERO3_LAYOUT), env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


@pytest.fixture
def zero3_run_env(zero3_run: tuple[Path, subprocess.CompletedProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The run folder, for spawned test processes (they inherit the environment, not fixtures)."""
    monkeypatch.setenv(ZERO3_RUN_ENV, str(zero3_run[0]))
