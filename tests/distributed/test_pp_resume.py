"""Checkpoints across pipeline layouts: a pp2 run (2 ranks, started by torchrun as users do) is
resumed by one process, whose checkpoint pp4 resumes, whose checkpoint tp2 x pp2 resumes; each
continues with the losses of the uninterrupted pp2 run (every fp32 layout trains the same global
batches; tolerance 1e-4 relative, the parity tests'). `trainfit export` of the pp2 run writes the
whole model (both stages' weights) as HF safetensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _dist import DP_BATCH, FourRankGlooTestCase, subprocess_env, torchrun, with_comms
from _runs import assert_export_matches, run_config, run_overrides
from trainfit.train.distributed import World
from trainfit.train.metrics import read_metrics
from trainfit.train.trainer import Trainer

CHAIN_ENV = "TRAINFIT_TEST_PP_CHAIN"
STEPS = 8
RUN = ("--model.num_layers=4", "--training.lr_schedule=constant")
"""pp4 needs a block per stage; each link of the chain is planned for fewer steps than the whole run,
and a constant rate (after the 2-step warm-up) is the same schedule whatever that plan."""
LOSS_RTOL = 1e-4
pytestmark = pytest.mark.slow


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "logs") if "loss" in r}


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "ckpt" / f"step_{step:08d}"


def resumed(run_dir: Path, start: Path, until: int, *layout: str, world: World | None = None) -> Trainer:
    return Trainer(run_config(run_dir, *DP_BATCH, *RUN, *layout, f"--training.steps={until}",
                              f"--checkpoint.resume={start}"), world=world)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chain's folder: the uninterrupted pp2 run in pp2/, then one process's run in one/."""
    root = tmp_path_factory.mktemp("pp_chain")
    proc = torchrun(2, "-m", "trainfit", "train",
                    *run_overrides(root / "pp2", *DP_BATCH, *RUN, f"--training.steps={STEPS}", "--parallel.pp=2",
                                   "--checkpoint.interval=2", "--checkpoint.keep_last=4"),
                    env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.replace("│", " ").split())
    assert "2 processes: pipeline pp=2 (1f1b, 2 stages of 2-2 blocks, 4 micro-batches)" in said
    trainer = resumed(root / "one", checkpoint(root / "pp2", 2), 4, world=World())
    assert trainer.step == 2 and any("saved by 2 ranks, resharded to 1" in note for note in trainer.notes)
    check_continuation(trainer.train().losses, logged_losses(root / "pp2"))
    return root


def check_continuation(losses: dict[int, float], expected: dict[int, float]) -> None:
    assert losses, "nothing was trained"
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=LOSS_RTOL), step


def test_export_writes_the_whole_model(chain: Path, tmp_path: Path) -> None:
    assert_export_matches(chain / "pp2" / "ckpt", tmp_path / "hf")


@pytest.fixture
def chain_env(chain: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's folder, for spawned test processes (they inherit the environment, not fixtures)."""
    monkeypatch.setenv(CHAIN_ENV, str(chain))


@pytest.mark.usefixtures("chain_env")
class FourRanks(FourRankGlooTestCase):
    @with_comms
    def test_pp4_then_tp2_pp2_continue(self) -> None:
        torch.set_num_threads(1)  # one per rank: the ranks share the machine's cores
        root = Path(os.environ[CHAIN_ENV])
        expected = logged_losses(root / "pp2")
        pp4 = resumed(self.shared_dir / "pp4", checkpoint(root / "one", 4), 6, "--parallel.pp=4")
        self.assertEqual(pp4.step, 4)
        losses = pp4.train().losses
        if self.rank == 0:
            check_continuation(losses, expected)
        tp_pp = resumed(self.shared_dir / "tp2_pp2", checkpoint(self.shared_dir / "pp4", 6), STEPS,
                        "--parallel.pp=2", "--parallel.tp=2")
        self.assertEqual(tp_pp.step, 6)
        losses = tp_pp.train().losses
        if self.rank == 0:
            check_continuation(losses, expected)
