"""A 2-rank ZeRO-3 run launched as users do (`torchrun ... -m trainfit train`), shared by the tests
of resuming its checkpoints elsewhere: on 1 process, on 4 ranks (HSDP), and exported to HF."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from _dist import DP_BATCH, ZERO3_LAYOUT, ZERO3_RUN_ENV, ZERO3_STEPS, subprocess_env, torchrun
from _runs import run_overrides


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("zero3_cli")
    proc = torchrun(2, "-m", "trainfit", "train", *run_overrides(run_dir, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                                                  *ZERO3_LAYOUT), env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


@pytest.fixture
def zero3_run_env(zero3_run: tuple[Path, subprocess.CompletedProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The run folder, for spawned test processes (they inherit the environment, not fixtures)."""
    monkeypatch.setenv(ZERO3_RUN_ENV, str(zero3_run[0]))
