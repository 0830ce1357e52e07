"""2-rank ZeRO-3 and ZeRO-1 runs launched as users do (`torchrun ... -m trainfit train`), shared by
the tests of resuming their checkpoints elsewhere: on 1 process, on 4 ranks (HSDP), in the other
layout, and exported to HF. The ZeRO-3 run also profiles one step (tests/distributed/test_profile_ranks.py);
the profiler does not change what a step computes."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from _dist import (
    DP_BATCH,
    REFERENCES_ENV,
    ZERO1_LAYOUT,
    ZERO1_RUN_ENV,
    ZERO3_LAYOUT,
    ZERO3_PROFILED_STEP,
    ZERO3_RUN_ENV,
    ZERO3_STEPS,
    subprocess_env,
    torchrun,
)
from _runs import run_overrides


@pytest.fixture(scope="session", autouse=True)
def _shared_references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One folder for the session's one-process reference runs: a parity test reads those another
    trained (GlooTestCase._reference), its ranks find it in the environment they are given."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(REFERENCES_ENV, str(tmp_path_factory.mktemp("references")))
        yield


def _cli_run(tmp_path_factory: pytest.TempPathFactory, name: str, layout: tuple[str, ...]
             ) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp(name)
    proc = torchrun(2, "-m", "trainfit", "train",
                    *run_overrides(run_dir, *DP_BATCH, f"--training.steps={ZERO3_STEPS}", *layout),
                    env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


@pytest.fixture(scope="session")
def zero3_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    return _cli_run(tmp_path_factory, "zero3_cli", (*ZERO3_LAYOUT, f"--profile={ZERO3_PROFILED_STEP}"))


@pytest.fixture(scope="session")
def zero1_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    return _cli_run(tmp_path_factory, "zero1_cli", ZERO1_LAYOUT)


@pytest.fixture
def zero3_run_env(zero3_run: tuple[Path, subprocess.CompletedProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """The run folder, for spawned test processes (they inherit the environment, not fixtures)."""
    monkeypatch.setenv(ZERO3_RUN_ENV, str(zero3_run[0]))


@pytest.fixture
def zero1_run_env(zero1_run: tuple[Path, subprocess.CompletedProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ZERO1_RUN_ENV, str(zero1_run[0]))
