"""Checkpoints of a 2-rank ZeRO-3 run started by torchrun (conftest.py) resume on 1 process and on
4 ranks with HSDP, export to HF, and survive a rank killed mid-save.

Resumed runs continue the same data stream (the global batch of a step does not depend on the
layout) and so the same losses as the uninterrupted 2-rank run, within fp32 reduction-order error
(measured 2e-7; tolerance 1e-5 relative).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _dist import DP_BATCH, FP32, ZERO3_RUN_ENV, ZERO3_STEPS, GlooTestCase, subprocess_env, torchrun, with_comms
from _runs import run_config, run_overrides
from trainfit.models import build_model, materialize
from trainfit.models.hf import load_hf_weights
from trainfit.train import checkpoint as ckpt
from trainfit.train.metrics import read_metrics
from trainfit.train.sample import load_trained_model
from trainfit.train.trainer import Trainer

LOSS_RTOL = 1e-5


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "logs") if "loss" in r}


def assert_same_losses(actual: dict[int, float], expected: dict[int, float], steps: range) -> None:
    assert sorted(actual) == list(steps)
    for step in steps:
        assert actual[step] == pytest.approx(expected[step], rel=LOSS_RTOL), step


def test_two_ranks_log_once_and_save_sharded_checkpoints(zero3_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, proc = zero3_run
    assert proc.stdout.count("run complete") == 1  # rank 0 alone prints
    assert "2 processes: ZeRO-3 (FSDP2) over dp_shard=2" in proc.stdout
    records = read_metrics(run_dir / "logs")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, ZERO3_STEPS + 1))
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3, 6]
    measured = next(r for r in records if r["step"] == 2 and "loss" in r)  # step 2 is measured
    assert 0 < measured["params_bytes"] < measured["optimizer_bytes"]  # rank 0's shards
    assert [p.name for p in ckpt.list_checkpoints(run_dir / "ckpt")] == ["step_00000003", "step_00000006"]
    shards = sorted(p.name for p in (run_dir / "ckpt" / "step_00000006" / ckpt.DCP_DIR).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote their shards


def test_resume_on_one_process_continues_the_same_losses(zero3_run: tuple[Path, subprocess.CompletedProcess],
                                                         tmp_path: Path) -> None:
    run_dir, _ = zero3_run
    saved = run_dir / "ckpt" / "step_00000003"
    trainer = Trainer(run_config(tmp_path, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                 f"--checkpoint.resume={saved}"))
    assert trainer.step == 3 and trainer.world.size == 1
    assert "saved by 2 ranks, resharded to 1" in trainer.notes[0]
    result = trainer.train()
    assert_same_losses(result.losses, logged_losses(run_dir), range(4, ZERO3_STEPS + 1))


def test_export_of_a_sharded_checkpoint(zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path) -> None:
    run_dir, _ = zero3_run
    proc = subprocess.run([sys.executable, "-m", "trainfit", "export", str(run_dir / "ckpt"), "--out",
                           str(tmp_path / "hf")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    ours, cfg, _ = load_trained_model(run_dir / "ckpt", torch.device("cpu"))
    exported = materialize(build_model(cfg.model), "cpu")
    load_hf_weights(exported, cfg.model, tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens), ours(tokens), rtol=0, atol=0)


@pytest.mark.usefixtures("zero3_run_env")
class FourRanks(GlooTestCase):
    """HSDP (2 replicas x 2 shards) trains like one process and resumes the 2-rank checkpoint."""

    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_hsdp(self) -> None:
        self.run_subtests({"case": ["hsdp", "zero1-replicated", "resume"]}, self._check)

    def _check(self, case: str) -> None:
        layout = ("--hardware.num_gpus=4", "--parallel.dp_replicate=2", "--training.micro_batch_size=1")
        if case == "hsdp":
            self.check_parity((*layout, "--parallel.zero_stage=3"), FP32)
        elif case == "zero1-replicated":  # optimizer states split within each replica
            self.check_parity((*layout, "--parallel.zero_stage=1"), FP32)
        else:
            run_dir = Path(os.environ[ZERO3_RUN_ENV])
            trainer = Trainer(run_config(self.shared_dir / "resume", *DP_BATCH, *layout, "--parallel.zero_stage=3",
                                         f"--training.steps={ZERO3_STEPS}",
                                         f"--checkpoint.resume={run_dir / 'ckpt' / 'step_00000003'}"))
            self.assertEqual(trainer.step, 3)
            result = trainer.train()
            if self.rank == 0:
                assert_same_losses(result.losses, logged_losses(run_dir), range(4, ZERO3_STEPS + 1))


KILL_RANK_1_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch.distributed.checkpoint as dcp
    from trainfit.cli import main

    save = dcp.save

    def save_then_die(*args, **kwargs):  # rank 1 dies once its shards of step 4 are written
        save(*args, **kwargs)
        if os.environ["RANK"] == "1" and "step_00000004" in str(kwargs["checkpoint_id"]):
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save = save_then_die
    sys.exit(main(sys.argv[1:]))
""")


def test_rank_killed_mid_save_leaves_the_last_checkpoint_loadable(
        zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1_MID_SAVE)
    run = tmp_path / "run"
    proc = torchrun(2, str(script), "train", *run_overrides(run, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                                            "--parallel.zero_stage=3", "--checkpoint.interval=2"),
                    env=subprocess_env(tmp_path_factory))
    assert proc.returncode != 0
    assert [p.name for p in ckpt.list_checkpoints(run / "ckpt")] == ["step_00000002"]
    assert any(p.name.startswith(".tmp-step_00000004") for p in (run / "ckpt").iterdir())
    trainer = Trainer(run_config(run, *DP_BATCH, f"--training.steps={ZERO3_STEPS}"))  # one process resumes it
    assert trainer.step == 2
    result = trainer.train()
    assert_same_losses(result.losses, logged_losses(zero3_run[0]), range(3, ZERO3_STEPS + 1))
    assert not any(p.name.startswith(".tmp-") for p in (run / "ckpt").iterdir())  # cleaned by the next save


def test_several_ranks_without_a_launcher_fail_fast_with_the_command(tmp_path: Path) -> None:
    args = ["train", "--hardware.num_gpus=2", "--parallel.zero_stage=3", "--training.micro_batch_size=8",
            f"--logging.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"torchrun --nproc_per_node=2 -m trainfit {' '.join(args)}" in proc.stderr
    assert not any(tmp_path.iterdir())
