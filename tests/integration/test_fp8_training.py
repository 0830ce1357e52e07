"""fp8-mixed trains like bf16-mixed: 50 steps of a narrowed debug model (2 blocks, dim 32, 2 rows of
32 tokens per step) from the same seed, on CPU (torch._scaled_mm's CPU kernel). Narrow and short
rows keep the fp8 matmuls' work small (tests/_fp8_flops.py): a CPU without fp8 hardware runs them
orders of magnitude slower than bf16.

Tolerances: 0.25 per step (single noisy steps) and 0.05 on the mean over the last 10 steps, on losses
falling by more than 2 from about 5.5; the gaps measured are in benchmarks/README.md ("fp8 GEMM work
of the tests"). Not bitwise equal: the float8 matmuls do run (their losses differ from bf16's from
step 1 on)."""

from __future__ import annotations

import pytest

from _runs import run_config
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

STEPS = 50
SHAPE = ("--model.dim=32", "--training.micro_batch_size=2", "--training.global_batch_size=2")
STEP_TOLERANCE, TAIL_TOLERANCE = 0.25, 0.05


def _losses(tmp_path, *overrides: str) -> list[float]:
    trainer = Trainer(run_config(tmp_path / "_".join(overrides), *SHAPE, *overrides, "--training.seed=0"),
                      world=World())
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
