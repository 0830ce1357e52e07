"""training.compile on one process: compiled blocks (with full activation checkpointing, whose
compiled recomputation the memory meter must follow) train like eager ones; the compiling step is
timed apart and left out of tokens/s; the measured step measures the compiled blocks (their
fused kernels keep fewer tensors, so its peak is below eager's). One 1-block model of the
shape tests/distributed/test_compile_parity.py compiles (whichever runs second loads inductor's
cached kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch._dynamo

from _runs import COMPILE_SHAPE, run_config
from trainfit.train.metrics import read_metrics
from trainfit.train.trainer import Trainer, TrainResult

RUN = (*COMPILE_SHAPE, "--training.micro_batch_size=2", "--training.global_batch_size=2", "--training.steps=3")
LOSS_RTOL = 1e-5
"""Inductor sums in another order than eager: fp32 rounding only (measured: up to 3e-7)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[TrainResult, Path]]:
    """An eager run and a compiled run of RUN (each: result, folder), shared by the tests below."""
    out = {}
    for compiled in (False, True):
        run_dir = tmp_path_factory.mktemp(f"compile-{compiled}")
        torch._dynamo.reset()
        cfg = run_config(run_dir, *RUN, f"--training.compile={str(compiled).lower()}")
        out[compiled] = Trainer(cfg).train(), run_dir
    return out


def test_compiled_blocks_train_like_eager(runs: dict[bool, tuple[TrainResult, Path]]) -> None:
    eager, compiled = runs[False][0], runs[True][0]
    assert sorted(compiled.losses) == [1, 2, 3]
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=LOSS_RTOL), step


def test_compile_time_is_reported_apart(runs: dict[bool, tuple[TrainResult, Path]]) -> None:
    (eager, _), (compiled, run_dir) = runs[False], runs[True]
    assert eager.compile_seconds == 0
    notes = [r for r in read_metrics(run_dir / "logs") if "compile_seconds" in r]
    assert [r["step"] for r in notes] == [1]  # the first step compiles; no recompiles
    assert compiled.compile_seconds == pytest.approx(notes[0]["compile_seconds"])
    assert notes[0]["note"].startswith("compile: ")
    # tokens/s from steps 2-3 alone: a step takes well under a second, the compiling one far more.
    assert compiled.tokens_per_s > compiled.layout.global_batch_size * 128 / compiled.compile_seconds


def test_measured_step_runs_compiled_blocks(runs: dict[bool, tuple[TrainResult, Path]]) -> None:
    eager, compiled = runs[False][0], runs[True][0]
    assert eager.memory is not None and compiled.memory is not None
    # Compiled recomputation fuses RMSNorm, RoPE and SwiGLU: its backward holds fewer temporaries.
    assert compiled.memory.peak < 0.95 * eager.memory.peak
