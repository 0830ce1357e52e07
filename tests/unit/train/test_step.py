"""The step's seam (train/step.py): forward_backward per micro-batch and optimizer_step, driven from
outside the step (as a pipeline schedule will), give the same step as calling it; listeners see its moments."""

from __future__ import annotations

from pathlib import Path

import torch

from _runs import run_overrides
from trainfit.configure import load_config
from trainfit.train.distributed import World
from trainfit.train.step import TrainStep
from trainfit.train.trainer import Trainer

ACCUM = ("--training.micro_batch_size=2", "--training.global_batch_size=4", "--training.steps=3")


def _trainer(run_dir: Path) -> Trainer:
    return Trainer(load_config(None, run_overrides(run_dir, *ACCUM, "--checkpoint.resume=never")), world=World())


def test_a_step_driven_from_outside_equals_train_step(tmp_path: Path) -> None:
    inside, outside = _trainer(tmp_path / "a"), _trainer(tmp_path / "b")
    for _ in range(2):
        stats = inside.train_step()
        losses = []
        for i in range(2):  # the micro-batches, as a schedule would hand them over
            inputs, targets = outside.sampler.next_batch()
            losses.append(outside.stepper.forward_backward(inputs, targets, num_microbatches=2, sync_gradients=i == 1))
        grad_norm, skipped, lr = outside.stepper.optimizer_step()
        assert torch.stack(losses).mean().item() == stats.loss
        assert (grad_norm, skipped, lr) == (stats.grad_norm, stats.skipped, stats.lr)
    for (name, a), b in zip(inside.model.state_dict().items(), outside.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_listeners_see_every_moment_in_order_and_only_inside_their_block(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path)
    seen: list[str] = []
    with trainer.listening(seen.append):
        trainer.train_step()
    trainer.train_step()  # after the block: not heard
    assert seen == ["forward", "backward", "forward", "backward", "optimizer", "update"]
    assert set(seen) == set(TrainStep.MOMENTS)
