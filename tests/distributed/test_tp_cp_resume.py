"""A checkpoint of a tp2 x dp2 run (4 ranks, sequence parallel, ZeRO-3, started by torchrun as
users do) resumes under one process, under cp2 and under tp2 and continues with the losses of the
uninterrupted run (every fp32 layout trains the same global batches; tolerance 1e-4 relative, the
parity tests'), and `trainfit export` writes its whole weights as HF safetensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _dist import DP_BATCH, ZERO3_STEPS, GlooTestCase, subprocess_env, torchrun, with_comms
from _runs import assert_export_matches, run_config, run_overrides
from trainfit.train.distributed import World
from trainfit.train.metrics import read_metrics
from trainfit.train.trainer import Trainer

TP_DP_RUN_ENV = "TRAINFIT_TEST_TP_DP_RUN"
TP_DP_LAYOUT = ("--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.zero_stage=3",
                "--checkpoint.interval=3", "--training.eval_interval=3")
LOSS_RTOL = 1e-4


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "logs") if "loss" in r}


def saved_at_step_3(run_dir: Path) -> Path:
    return run_dir / "ckpt" / "step_00000003"


@pytest.fixture(scope="module")
def tp_dp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("tp2_dp2_cli")
    proc = torchrun(4, "-m", "trainfit", "train",
                    *run_overrides(run_dir, *DP_BATCH, f"--training.steps={ZERO3_STEPS}", *TP_DP_LAYOUT),
                    env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stdout.replace("\n", " ").replace("│", " ")
    assert "4 processes: ZeRO-3 (FSDP2) over dp_shard=2, tensor parallel tp=2" in " ".join(said.split())
    return run_dir


@pytest.fixture
def tp_dp_run_env(tp_dp_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run folder, for spawned test processes (they inherit the environment, not fixtures)."""
    monkeypatch.setenv(TP_DP_RUN_ENV, str(tp_dp_run))


def test_resume_on_one_process(tp_dp_run: Path, tmp_path: Path) -> None:
    trainer = Trainer(run_config(tmp_path, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                 f"--checkpoint.resume={saved_at_step_3(tp_dp_run)}"), world=World())
    assert trainer.step == 3 and any("saved by 4 ranks, resharded to 1" in note for note in trainer.notes)
    expected = logged_losses(tp_dp_run)
    for step, loss in trainer.train().losses.items():
        assert loss == pytest.approx(expected[step], rel=LOSS_RTOL), step


def test_export_writes_the_whole_weights(tp_dp_run: Path, tmp_path: Path) -> None:
    assert_export_matches(tp_dp_run / "ckpt", tmp_path / "hf")


@pytest.mark.usefixtures("tp_dp_run_env")
class TwoRanks(GlooTestCase):
    @with_comms
    def test_resume_under_cp2_and_tp2(self) -> None:
        torch.set_num_threads(1)  # one per rank: the ranks share the machine's cores
        self.run_subtests({"layout": [("--parallel.cp=2",), ("--parallel.tp=2",)]}, self._resume)

    def _resume(self, layout: tuple[str, ...]) -> None:
        run_dir = Path(os.environ[TP_DP_RUN_ENV])
        trainer = Trainer(run_config(self.shared_dir / "-".join(layout), *DP_BATCH, *layout,
                                     f"--training.steps={ZERO3_STEPS}",
                                     f"--checkpoint.resume={saved_at_step_3(run_dir)}"))
        self.assertEqual(trainer.step, 3)
        result = trainer.train()
        if self.rank == 0:
            expected = logged_losses(run_dir)
            self.assertEqual(sorted(result.losses), list(range(4, ZERO3_STEPS + 1)))
            for step, loss in result.losses.items():
                self.assertAlmostEqual(loss, expected[step], delta=LOSS_RTOL * abs(expected[step]), msg=str(step))
