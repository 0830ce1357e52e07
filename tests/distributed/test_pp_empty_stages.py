"""Pipeline stages without blocks before the last (nanotron's compute-balanced split leaves such stages:
16 layers on pp8 as 3,3,2,3,2,3,0,0) train like one process (tests/_dist.py's check_parity, test_pp_end_stages.py's
tolerance). A 4-block debug Llama on 3 gloo ranks, rank 1 holding a stage of no block, nor the embedding or
the head: no parameter at all. It passes its input on (parallel/pipeline.py's _PassOn) under 1F1B (2,0,2) and
GPipe (4,0,0: rank 2 then holds the head alone), still enters the step's collectives (gradient clipping's norm
over pp, the loss's reduction, the checkpoint's save and load), and a trainer started again in the run's
folder loads the run's last checkpoint, that rank loading nothing. On 4 ranks, pp2 x dp2 under ZeRO-3: FSDP2
over such a rank's stages (ZBV_FSDP). Its estimates: tests/estimator/test_consistency.py's pp3-empty-inner
points."""

from __future__ import annotations

import pytest

import _dist
from _dist import DP_BATCH, FourRankGlooTestCase, GlooTestCase, parity_name, with_comms
from _runs import run_config
from trainfit.train.trainer import Trainer

PP_FP32 = {"loss_rtol": 1e-4, "update_rtol": 1e-4}
STEPS = 4
PP3 = ("--model.num_layers=4", "--hardware.num_gpus=3", "--parallel.pp=3")
ONE_F_ONE_B = (*PP3, "--parallel.pp_layers_per_stage=2,0,2")
GPIPE = (*PP3, "--parallel.pp_layers_per_stage=4,0,0", "--parallel.pp_schedule=gpipe")
ZBV_FSDP = ("--model.num_layers=4", "--hardware.num_gpus=4", "--parallel.pp=2",
            "--parallel.pp_schedule=zbv-zero-bubble", "--parallel.pp_layers_per_stage=4,0,0,0",
            "--parallel.zero_stage=3")
"""pp2 x dp2, ZeRO-3: a V puts stages 1 and 2 on pipeline rank 1, both without blocks: its two data-parallel ranks
shard nothing (FSDP2 over a module without parameters), and the first rank holds the head too."""
pytestmark = pytest.mark.slow


class ThreeRanks(GlooTestCase):
    @property
    def world_size(self) -> int:
        return 3

    @with_comms
    def test_stages_without_blocks_between_the_ends(self) -> None:
        self.check_cases([(ONE_F_ONE_B, PP_FP32, STEPS), (GPIPE, PP_FP32, STEPS)])
        self.check_resumed(ONE_F_ONE_B)

    def check_resumed(self, overrides: tuple[str, ...]) -> None:
        """A trainer of `overrides` started in check_parity's run folder resumes at its last step with the
        weights one process ended with (the checkpoint's, loaded by every rank)."""
        trainer = Trainer(run_config(self.shared_dir / parity_name(overrides, STEPS), *DP_BATCH,
                                     f"--training.steps={STEPS}", "--logging.measure_memory=false", *overrides))
        self.assertEqual(trainer.step, STEPS)
        params = _dist.full_params(trainer)
        if self.rank != 0:
            return
        reference = self._reference(parity_name(overrides, STEPS),
                                    tuple(o for o in overrides if not o.startswith(_dist.LAYOUT_FIELDS)), STEPS)
        error = sum(((params[key] - value) ** 2).sum() for key, value in reference.final.items()).sqrt()
        moved = sum(((value - reference.initial[key]) ** 2).sum() for key, value in reference.final.items()).sqrt()
        self.assertEqual(set(params), set(reference.final))
        self.assertLess(float(error / moved), PP_FP32["update_rtol"])


class FourRanks(FourRankGlooTestCase):
    @with_comms
    def test_fully_sharded_ranks_without_parameters(self) -> None:
        self.check_cases([(ZBV_FSDP, PP_FP32, STEPS)])
