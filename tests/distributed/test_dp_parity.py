"""Every data-parallel layout trains like one process: 2 gloo ranks, global batch 8 (2 ranks x 2
micro-batches x 2 rows), 4 AdamW steps, against one process taking the same 8 rows per step at once.

Two measures: the loss of every step (relative error), and the final parameters as
||theta_parallel - theta_single|| / ||theta_single - theta_init|| over all parameters, i.e. the error
relative to the distance training moved them (elementwise errors mislead: Adam's first updates
are +-lr whatever a gradient's size, so an element whose gradient is ~0 may flip sign with the
summation order of the reduction).

Measured (and the tolerance): fp32, every layout: loss 2e-7, parameters 4e-7 (1e-5; the largest
elementwise difference is 5e-7, on parameters of ~0.02). Autocast layouts (DDP bf16-mixed, ZeRO-1
fp16-mixed): loss 1e-5, parameters 7e-3 (1e-4, 2e-2). FSDP2 low precision: bf16-mixed there computes with bf16
*parameters* (MixedPrecisionPolicy) where one process autocasts fp32 ones per operator, so the
residual stream rounds differently: loss 1.3e-4, parameters 2.6e-2; fp16-mixed 1e-5, 7e-3;
bf16-pure 7e-5, 1.3e-2 (1e-3, 6e-2). MoE: top-2 routing turns 1e-7 differences into different
experts for a few tokens, in DDP as in FSDP: loss 5e-5, parameters 7e-2 (1e-3, 0.2).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from _dist import AUTOCAST, DP_BATCH, FP32, LOW, MOE, STEPS, GlooTestCase, full_params, with_comms
from _runs import run_config
from trainfit.train.trainer import Trainer, TrainingDiverged

pytestmark = pytest.mark.slow  # 16 layouts, each trained on 2 ranks and on one process: minutes


class DataParallelParity(GlooTestCase):
    def run_cases(self, cases: list[tuple[tuple[str, ...], dict[str, float]]]) -> None:
        self.run_subtests({"case": cases}, lambda case: self.check_parity(*case))

    @with_comms
    def test_ddp(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=0",), FP32),
            (("--parallel.zero_stage=0", "--precision.mode=bf16-mixed"), AUTOCAST),
            (("--parallel.zero_stage=0", "--memory.activation_checkpointing=full", "--model.preset=debug-gpt2"),
             FP32),
        ])

    @with_comms
    def test_zero1(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=1",), FP32),
            (("--parallel.zero_stage=1", "--precision.mode=fp16-mixed"), AUTOCAST),
        ])

    @with_comms
    def test_zero2(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=2",), FP32),
            (("--parallel.zero_stage=2", "--precision.mode=bf16-mixed"), LOW),
        ])

    @with_comms
    def test_zero3(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=3",), FP32),
            (("--parallel.zero_stage=3", "--precision.mode=bf16-mixed"), LOW),
            (("--parallel.zero_stage=3", "--precision.mode=fp16-mixed"), LOW),
            (("--parallel.zero_stage=3", "--precision.mode=bf16-pure"), LOW),
            (("--parallel.zero_stage=3", "--memory.activation_checkpointing=selective"), FP32),
            (("--parallel.zero_stage=3", "--model.preset=debug-gpt2"), FP32),  # tied embedding/output
            (("--parallel.zero_stage=3", "--model.preset=debug-moe"), MOE),
        ])

    @with_comms
    def test_cpu_offload(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=2", "--memory.offload=optimizer"), FP32),
            (("--parallel.zero_stage=3", "--memory.offload=optimizer+params"), FP32),
        ])

    @with_comms
    def test_a_signal_or_a_nan_on_one_rank_stops_every_rank(self) -> None:
        self.run_subtests({"stage": [0, 3]}, self._check_sigterm_resume)
        self._check_nan_on_one_rank()

    def _check_sigterm_resume(self, stage: int) -> None:
        """SIGTERM reaching rank 1 only, after step 3: both ranks stop after the same step and save
        one checkpoint; the same command resumes, and ends exactly where an uninterrupted run does."""
        overrides = (f"--training.steps={STEPS + 2}", f"--parallel.zero_stage={stage}")
        straight = Trainer(run_config(self.shared_dir / f"straight{stage}", *DP_BATCH, *overrides))
        expected = straight.train().losses
        expected_params = full_params(straight.model)

        run_dir = self.shared_dir / f"interrupted{stage}"
        first = Trainer(run_config(run_dir, *DP_BATCH, *overrides))
        original = first.train_step

        def step_then_signal():
            stats = original()
            if first.step == 3 and self.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return stats

        first.train_step = step_then_signal
        stopped = first.train()
        self.assertTrue(stopped.stopped_by_signal)
        self.assertEqual(stopped.steps_done, 3)
        second = Trainer(run_config(run_dir, *DP_BATCH, *overrides))
        self.assertEqual(second.step, 3)
        resumed = second.train()
        self.assertEqual({**stopped.losses, **resumed.losses}, expected)  # bitwise
        params = full_params(second.model)
        for key, value in expected_params.items():
            self.assertTrue(torch.equal(params[key], value), key)

    def _check_nan_on_one_rank(self) -> None:
        """A nan loss on rank 1 only: the loss every rank sees is the global one, so all stop at once."""
        run_dir = self.shared_dir / "nan"
        trainer = Trainer(run_config(run_dir, *DP_BATCH, f"--training.steps={STEPS}", "--parallel.zero_stage=3"))
        original = trainer._loss

        def poisoned(inputs: torch.Tensor, targets: torch.Tensor):
            loss, lm_loss = original(inputs, targets)
            if trainer.step == 2 and self.rank == 1:
                return loss * float("nan"), lm_loss * float("nan")
            return loss, lm_loss

        trainer._loss = poisoned
        with self.assertRaisesRegex(TrainingDiverged, "step 3: the loss is nan"):
            trainer.train()
        self.assertFalse((run_dir / "ckpt").exists())  # nothing saved over the last good checkpoint
