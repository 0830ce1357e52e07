"""Pipeline-parallel layouts train like one process: AdamW steps on 2 and 4 gloo ranks against one
process taking the same global batches (tests/_dist.py's check_parity: the loss of every step and
both evaluations, and the final weights relative to how far training moved them).

The issue's layouts: pp2 with every schedule, pp4 with an uneven split, pp2 x dp2 (FSDP), pp2 x tp2
and pp2 x ep2 train _dist.LONG_STEPS (8; 20 when the docs' table was measured:
TRAINFIT_PARITY_LONG_STEPS=20); compositions beside them (checkpointing, bf16, fp16, clipping, more
micro-batches, sequence parallelism, context parallelism, ZeRO-2 under a zero-bubble schedule) 4;
MoE's auxiliary losses across stages LONG_STEPS. The debug model has 2 blocks: two-stage-per-rank
schedules on pp2 need 4 stages, so those cases give the model 4 blocks (one per stage) and the
others 2 or 6.

Tolerance, the issue's: fp32 loss and parameters within 1e-4 relative (bf16-mixed: _dist.AUTOCAST,
as for data parallelism). The measured errors are printed (pytest -s).
"""

from __future__ import annotations

import pytest

from _dist import AUTOCAST, GEMMA3, LONG_STEPS, MIXED_MOE, FourRankGlooTestCase, GlooTestCase, with_comms

PP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
STEPS, COMPOSITION_STEPS = LONG_STEPS, 4
FOUR_BLOCKS = "--model.num_layers=4"
pytestmark = pytest.mark.slow  # each layout trained on the ranks and on one process


def schedule(name: str) -> tuple[str, ...]:
    """The overrides of parallel.pp_schedule=`name` on pp2 (4 blocks: every schedule has its stages)."""
    return ("--parallel.pp=2", f"--parallel.pp_schedule={name}", FOUR_BLOCKS)


class TwoRanks(GlooTestCase):
    @with_comms
    def test_every_schedule(self) -> None:
        self.check_cases([
            (("--parallel.pp=2", "--parallel.pp_schedule=gpipe"), PP_FP32, STEPS),
            (("--parallel.pp=2", "--parallel.pp_schedule=1f1b"), PP_FP32, STEPS),
            (schedule("interleaved-1f1b"), PP_FP32, STEPS),
            (schedule("looped-bfs"), PP_FP32, STEPS),
            (schedule("interleaved-zero-bubble"), PP_FP32, STEPS),
            (schedule("zbv-zero-bubble"), PP_FP32, STEPS),
            (schedule("dualpipev"), PP_FP32, STEPS),
        ])

    @with_comms
    def test_compositions(self) -> None:
        self.check_cases([
            # The auxiliary losses of both stages reach their routers. The reference accumulates the same
            # 2-row micro-batches (the load-balancing loss of 8 rows at once is another function).
            (("--parallel.pp=2", "--model.preset=debug-moe", "--training.micro_batch_size=2"), PP_FP32, STEPS),
            # dense and MoE layers: the split weighs each block by its kind
            (("--parallel.pp=2", "--model.preset=debug-moe", "--training.micro_batch_size=2", *MIXED_MOE), PP_FP32,
             COMPOSITION_STEPS),
            (("--parallel.pp=2", "--memory.activation_checkpointing=full"), PP_FP32, COMPOSITION_STEPS),
            (("--parallel.pp=2", "--precision.mode=bf16-mixed"), AUTOCAST, COMPOSITION_STEPS),
            (("--parallel.pp=2", "--training.grad_clip=0.05"), PP_FP32, COMPOSITION_STEPS),  # clips every step
            (("--parallel.pp=2", "--parallel.num_microbatches=8"), PP_FP32, COMPOSITION_STEPS),
            # fp16 loss scaling: the scale is the same on both stages, the inf check spans them
            (("--parallel.pp=2", "--precision.mode=fp16-mixed"), AUTOCAST, COMPOSITION_STEPS),
            # a sliding window (8 of the 32 positions): each stage builds its mask
            (("--parallel.pp=2", "--model.sliding_window=8"), PP_FP32, COMPOSITION_STEPS),
            (("--parallel.pp=2", "--model.norm_placement=post", "--model.qk_norm=whole"), PP_FP32, COMPOSITION_STEPS),
            # Gemma 3's pattern (two windowed layers to one global) cut inside its period: layers 0-1 and 2-3
            (("--parallel.pp=2", *GEMMA3, "--model.num_layers=4", "--model.sliding_window_pattern=3"), PP_FP32,
             COMPOSITION_STEPS),
        ])


class FourRanks(FourRankGlooTestCase):
    @with_comms
    def test_four_ranks(self) -> None:
        self.check_cases([
            (("--parallel.pp=4", "--model.num_layers=6", "--parallel.pp_layers_per_stage=1,2,2,1"), PP_FP32, STEPS),
            (("--parallel.pp=2", "--parallel.zero_stage=3"), PP_FP32, STEPS),  # pp2 x dp2
            (("--parallel.pp=2", "--parallel.tp=2"), PP_FP32, STEPS),
            # experts split over the 2 ranks of each stage (ep2 x pp2), auxiliary losses carried across stages
            (("--parallel.pp=2", "--parallel.ep=2", "--parallel.zero_stage=3", "--model.preset=debug-moe",
              "--training.micro_batch_size=2"), PP_FP32, STEPS),
            # sequence-sharded activations between the stages
            (("--parallel.pp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"), PP_FP32, COMPOSITION_STEPS),
            (("--parallel.pp=2", "--parallel.cp=2", "--parallel.zero_stage=3"), PP_FP32, COMPOSITION_STEPS),
            (("--parallel.pp=2", "--parallel.zero_stage=2", "--parallel.pp_schedule=zbv-zero-bubble", FOUR_BLOCKS),
             PP_FP32, COMPOSITION_STEPS),
        ])
