"""fp8-mixed trains like bf16-mixed: 50 steps of the debug model (2 blocks, dim 64, 32-token
sequences, 4 rows per step) from the same seed, on CPU (torch._scaled_mm's CPU kernel).

Measured: the largest per-step loss difference against bf16-mixed over the 50 steps was 0.127
(tensorwise) and 0.093 (rowwise) on losses falling from 5.5 to 2.8 (single noisy steps), the mean
over the last 10 steps within 0.016 and 0.011; tolerances 0.25 per step and 0.05 on the last-10
mean. Not bitwise equal: the float8 matmuls do run (their losses differ from bf16's from step 1 on)."""

from __future__ import annotations

import pytest

from _runs import run_config
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

STEPS = 50
STEP_TOLERANCE, TAIL_TOLERANCE = 0.25, 0.05


def _losses(tmp_path, *overrides: str) -> list[float]:
    trainer = Trainer(run_config(tmp_path / "_".join(overrides), *overrides, "--training.seed=0"), world=World())
    return [trainer.train_step().loss for _ in range(STEPS)]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory) -> list[float]:
    return _losses(tmp_path_factory.mktemp("bf16"), "--precision.mode=bf16-mixed")


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_losses_follow_bf16_over_50_steps(tmp_path, bf16_losses, scaling: str) -> None:
    fp8 = _losses(tmp_path, "--precision.mode=fp8-mixed", f"--precision.fp8_scaling={scaling}")
    gaps = [abs(a - b) for a, b in zip(fp8, bf16_losses, strict=True)]
    print(f"fp8 {scaling}: largest step gap {max(gaps):.3f}, last-10 mean gap "
          f"{abs(sum(fp8[-10:]) - sum(bf16_losses[-10:])) / 10:.3f}")
    assert fp8[0] != bf16_losses[0]  # float8 matmuls ran
    assert max(gaps) < STEP_TOLERANCE
    assert abs(sum(fp8[-10:]) - sum(bf16_losses[-10:])) / 10 < TAIL_TOLERANCE
    assert fp8[-1] < fp8[0] - 2  # it learns
