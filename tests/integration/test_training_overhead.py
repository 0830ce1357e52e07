"""benchmarks/training_overhead.py compares trainfit's Trainer with a minimal hand-written loop; the
comparison means something only if both train the same thing. Same config, seed and batches: the two
must give the same loss at every step, bit for bit (same kernels in the same order), in fp32 and
bf16-mixed; a step that the Trainer did differently (batches, initialization, clipping, weight decay
groups, schedule, autocast) would change the losses from the second step on."""

from __future__ import annotations

from pathlib import Path

import pytest

from _runs import load_benchmark

bench = load_benchmark("training_overhead")


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_hand_loop_and_trainer_give_the_same_losses(tmp_path: Path, precision: str) -> None:
    # A clip low enough to act, and steps past the one warm-up step: every part of the step matters.
    cfg = bench.run_config(tmp_path, ("--model.preset=debug",), precision, 3, "--training.seq_len=32",
                           "--training.micro_batch_size=4", "--training.grad_clip=0.1")
    hand = bench.hand_loop(cfg)
    assert hand[2] < hand[0]  # it trains
    assert bench.trainfit_loop(cfg) == hand
