"""Every data-parallel layout trains like one process: 2 gloo ranks, global batch 8 (2 ranks x 2
micro-batches x 2 rows), 4 AdamW steps, against one process taking the same 8 rows per step at once;
and every ZeRO stage over _dist.LONG_STEPS (8) fp32 steps on 2 and on 4 ranks (4 x 1 micro-batch of
2 rows).

Two measures: the loss of every step and both evaluations (relative error), and the final weights
(the ones the optimizer updates: ZeRO-1's fp32 master shards, not its 16-bit parameters) as
||theta_parallel - theta_single|| / ||theta_single - theta_init|| over all parameters, i.e. the error
relative to the distance training moved them (elementwise errors mislead: Adam's first updates
are +-lr whatever a gradient's size, so an element whose gradient is ~0 may flip sign with the
summation order of the reduction).

Measured (and the tolerance), `pytest -s` prints them: fp32, every layout: loss 2e-7, parameters
4e-7 (3e-6 on the tied GPT-2) (1e-5, 1e-4: on an AMD EPYC the same DDP run gives 1.0e-5, see
_dist.FP32); stages 0-3 on 2 and 4 ranks over 20 steps (TRAINFIT_PARITY_LONG_STEPS=20): loss 1.3e-7
to 1.8e-7, parameters 2.6e-7 to 2.8e-7 (1e-5, 1e-4); ZeRO-1 with gradient clipping at 0.05 on the
tied GPT-2: 1.9e-7, 5.6e-7. DDP bf16-mixed (autocast, like one process): loss 1e-5, parameters 7e-3
(1e-4, 2e-2). Layouts that compute with 16-bit *parameters* where one process autocasts fp32 ones
per operator (FSDP2's MixedPrecisionPolicy, ZeRO-1) round the residual stream differently:
bf16-mixed loss 1.1e-4 to 1.6e-4, parameters 2.4e-2 to 2.6e-2 (ZeRO-1 with fp32 gradient
accumulation alike); fp16-mixed 1.6e-5 to 1.8e-5, 7e-3 to 8e-3; bf16-pure 8e-5 to 9e-5, 1.3e-2 to
1.4e-2 (1e-3, 6e-2). MoE: top-2 routing turns 1e-7 differences into different experts for a few
tokens, in DDP as in FSDP: loss 5e-5, parameters 7e-2 (1e-3, 0.2).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from _dist import (
    AUTOCAST,
    DP_BATCH,
    FP32,
    GEMMA2,
    GEMMA3,
    GPT_OSS,
    LONG_STEPS,
    LOW,
    MOE,
    STEPS,
    FourRankGlooTestCase,
    GlooTestCase,
    full_params,
    with_comms,
)
from _runs import run_config
from trainfit.train.trainer import Trainer, TrainingDiverged

pytestmark = pytest.mark.slow  # 16 layouts, each trained on 2 ranks and on one process: minutes


class DataParallelParity(GlooTestCase):
    def run_cases(self, cases: list[tuple[tuple[str, ...], dict[str, float]]]) -> None:
        self.run_subtests({"case": cases}, self.check_case)

    def check_case(self, case: tuple[tuple[str, ...], dict[str, float]]) -> None:
        self.check_parity(*case)  # pytest -s shows the measured errors the module docstring quotes

    @with_comms
    def test_ddp(self) -> None:
        self.run_cases([
            (("--parallel.zero_stage=0",), FP32),
            (("--parallel.zero_stage=0", "--precision.mode=bf16-mixed"), AUTOCAST),
            (("--parallel.zero_stage=0", "--memory.activation_checkpointing=full", "--model.preset=debug-gpt2"),
             FP32),
        ])

    @with_comms
    def test_every_zero_stage_over_more_steps(self) -> None:
        self.run_subtests({"stage": [0, 1, 2, 3]}, self.check_stage_over_more_steps)

    def check_stage_over_more_steps(self, stage: int) -> None:
        self.check_parity((f"--parallel.zero_stage={stage}",), FP32, steps=LONG_STEPS)

    @with_comms
    def test_zero1(self) -> None:
        """Every precision (the 16-bit ones compute with 16-bit parameters, like FSDP2), fp16 loss
        scaling, fp32 gradient accumulation; 2 micro-batches per rank, clipping, evaluation."""
        self.run_cases([
            (("--parallel.zero_stage=1", "--precision.mode=bf16-mixed"), LOW),
            (("--parallel.zero_stage=1", "--precision.mode=bf16-mixed", "--optimizer.grad_accum_dtype=fp32"), LOW),
            (("--parallel.zero_stage=1", "--precision.mode=fp16-mixed"), LOW),
            (("--parallel.zero_stage=1", "--precision.mode=bf16-pure"), LOW),
            (("--parallel.zero_stage=1", "--model.preset=debug-gpt2", "--training.grad_clip=0.05"), FP32),
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
            # Qwen3's block (QK-norm, heads wider than the model) and Qwen3-MoE's
            (("--parallel.zero_stage=3", "--model.qk_norm=head", "--model.head_dim=24"), FP32),
            # OLMo 2's block: norms after the branches, QK-norm over all heads
            (("--parallel.zero_stage=3", "--model.norm_placement=post", "--model.qk_norm=whole"), FP32),
            (("--parallel.zero_stage=3", *GEMMA3), FP32),  # Gemma 3's block
            (("--parallel.zero_stage=3", *GEMMA2), FP32),  # Gemma 2's
            # OLMoE's: QK-norm over all heads, the top-k routing weights as the softmax gave them
            (("--parallel.zero_stage=3", "--model.preset=debug-moe", "--model.qk_norm=whole",
              "--model.router_normalize_topk=false", "--model.num_shared_experts=0"), MOE),
            (("--parallel.zero_stage=3", "--model.preset=debug-moe", "--model.qk_norm=head", "--model.head_dim=24",
              "--model.num_shared_experts=0"), MOE),
            (("--parallel.zero_stage=3", "--model.preset=debug-moe", *GPT_OSS), MOE),  # gpt-oss's
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
        expected_params = full_params(straight)

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
        params = full_params(second)
        for key, value in expected_params.items():
            self.assertTrue(torch.equal(params[key], value), key)

    def _check_nan_on_one_rank(self) -> None:
        """A nan loss on rank 1 only: the loss every rank sees is the global one, so all stop at once."""
        run_dir = self.shared_dir / "nan"
        trainer = Trainer(run_config(run_dir, *DP_BATCH, f"--training.steps={STEPS}", "--parallel.zero_stage=3"))
        original = trainer.stepper.loss

        def poisoned(inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None):
            loss, lm_loss = original(inputs, targets, documents)
            if trainer.step == 2 and self.rank == 1:
                return loss * float("nan"), lm_loss * float("nan")
            return loss, lm_loss

        trainer.stepper.loss = poisoned
        with self.assertRaisesRegex(TrainingDiverged, "step 3: the loss is nan"):
            trainer.train()
        self.assertFalse((run_dir / "ckpt").exists())  # nothing saved over the last good checkpoint



class FourRanks(FourRankGlooTestCase):
    """Every ZeRO stage on 4 ranks (global batch 8: one micro-batch of 2 rows per rank)."""

    test_every_zero_stage_over_more_steps = DataParallelParity.test_every_zero_stage_over_more_steps
    check_stage_over_more_steps = DataParallelParity.check_stage_over_more_steps
