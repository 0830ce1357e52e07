"""Every layout starts from the same weights, with no broadcast: each rank initializes only what it
holds from (seed, parameter name) (models/init.py). One process, 2-rank DDP, 2-rank ZeRO-3 and
4-rank HSDP give bit-identical full weights, and a sharded rank never allocates more than its shard."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from _dist import FourRankGlooTestCase, GlooTestCase, full_params, with_comms
from _runs import run_config
from trainfit.models import build_model, materialize
from trainfit.train.trainer import Trainer

MODELS = ("--model.preset=debug", "--model.preset=debug-gpt2", "--model.preset=debug-moe")


class InitOnTwoRanks(GlooTestCase):
    @with_comms
    def test_ddp_and_zero3_start_from_the_one_process_weights(self) -> None:
        self.run_subtests({"model": list(MODELS), "layout": [("--parallel.zero_stage=0",),
                                                             ("--parallel.zero_stage=3",
                                                              "--memory.activation_checkpointing=full")]},
                          self._check_init)

    def _check_init(self, model: str, layout: tuple[str, ...]) -> None:
        check_init(self, model, layout)


class InitOnFourRanks(FourRankGlooTestCase):
    @with_comms
    def test_hsdp_starts_from_the_one_process_weights(self) -> None:
        check_init(self, "--model.preset=debug", ("--parallel.dp_replicate=2", "--parallel.zero_stage=3"))


def check_init(case: GlooTestCase, model: str, layout: tuple[str, ...]) -> None:
    name = (model + "".join(layout)).replace("-", "").replace("=", "").replace(".", "")
    cfg = run_config(case.shared_dir / name, model, *layout, "--checkpoint.resume=never",
                     "--training.global_batch_size=8", "--training.micro_batch_size=1")
    trainer = Trainer(cfg)
    for param_name, param in trainer.model.named_parameters():
        if isinstance(param, DTensor):  # this rank's shard, at most a 1/dp_shard share of the rows
            share = math.ceil(param.shape[0] / trainer.layout.dp_shard) * math.prod(param.shape[1:])
            case.assertLessEqual(param.to_local().numel(), share, param_name)
    gathered = full_params(trainer)
    reference = materialize(build_model(cfg.model), "cpu", cfg.training.seed).state_dict()
    case.assertEqual(sorted(gathered), sorted(reference))
    for key, value in reference.items():
        case.assertTrue(torch.equal(gathered[key], value.float()), f"{model} {layout} {key}")
