"""Tensor, sequence and context parallel layouts train like one process: 20 AdamW steps on 2 and 4
gloo ranks against one process taking the same global batches (tests/_dist.py's check_parity: the
loss of every step and both evaluations, and the final weights relative to how far training moved
them).

Tolerance, the issue's: fp32 loss and parameters within 1e-4 relative (bf16-mixed: _dist.AUTOCAST;
MoE: _dist.MOE, as for data parallelism).
The measured errors are printed (pytest -s) and quoted in README's parallelism section.
"""

from __future__ import annotations

import pytest

from _dist import AUTOCAST, MOE, GlooTestCase, with_comms

TP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
STEPS = 20
SP = "--parallel.sequence_parallel=true"
pytestmark = pytest.mark.slow  # each layout trained on the ranks and on one process


class TwoRanks(GlooTestCase):
    def check_case(self, case: tuple[tuple[str, ...], dict[str, float]]) -> None:
        steps = STEPS if case[1] is not MOE else 4  # routing flips compound over steps (see MOE)
        errors = self.check_parity(case[0], case[1], steps=steps)
        if errors:  # pytest -s shows the measured errors
            print(f"world {self.world_size}, {' '.join(case[0])}: loss {errors[0]:.1e}, parameters {errors[1]:.1e}")

    @with_comms
    def test_tensor_parallel(self) -> None:
        self.run_subtests({"case": [
            (("--parallel.tp=2",), TP_FP32),
            (("--parallel.tp=2", SP), TP_FP32),
            (("--parallel.tp=2", SP, "--model.preset=debug-gpt2"), TP_FP32),  # tied, learned positions
            # experts replicated; top-2 routing turns 1e-7 differences into other experts for a few
            # tokens, as under data parallelism (test_dp_parity.py)
            (("--parallel.tp=2", SP, "--model.preset=debug-moe"), MOE),
            (("--parallel.tp=2", SP, "--memory.activation_checkpointing=full"), TP_FP32),
            (("--parallel.tp=2", SP, "--precision.mode=bf16-mixed"), AUTOCAST),
            (("--parallel.tp=2", "--model.vocab_size=511"), TP_FP32),  # uneven vocabulary shards
        ]}, self.check_case)

    @with_comms
    def test_context_parallel(self) -> None:
        self.run_subtests({"case": [
            (("--parallel.cp=2",), TP_FP32),  # gradients averaged over the cp ranks by DDP
            (("--parallel.cp=2", "--parallel.zero_stage=3"), TP_FP32),  # states sharded over cp
            (("--parallel.cp=2", "--parallel.zero_stage=1", "--model.preset=debug-gpt2"), TP_FP32),
        ]}, self.check_case)


class FourRanks(GlooTestCase):
    @property
    def world_size(self) -> int:
        return 4

    check_case = TwoRanks.check_case

    @with_comms
    def test_four_ranks(self) -> None:
        self.run_subtests({"case": [
            (("--parallel.tp=4", SP, "--model.num_kv_heads=4"), TP_FP32),
            (("--parallel.tp=2", "--parallel.zero_stage=3"), TP_FP32),  # tp2 x dp2
            (("--parallel.tp=2", "--parallel.zero_stage=3", "--memory.offload=optimizer+params"), TP_FP32),
            (("--parallel.tp=2", SP, "--parallel.zero_stage=2", "--model.preset=debug-gpt2"), TP_FP32),
            (("--parallel.cp=2", "--parallel.tp=2", SP, "--parallel.zero_stage=3"), TP_FP32),
            (("--parallel.cp=2", "--parallel.zero_stage=2"), TP_FP32),  # cp2 x dp2
        ]}, self.check_case)
