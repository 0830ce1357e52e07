"""Checkpoints of 2-rank ZeRO-3 and ZeRO-1 runs started by torchrun (conftest.py) resume on 1
process, on 4 ranks with HSDP and in each other's layout (a one-process checkpoint in ZeRO-1's too),
export to HF (ZeRO-1's: its fp32 master weights), and survive a rank killed mid-save.

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

from _dist import (
    DP_BATCH,
    FP32,
    ZERO1_RUN_ENV,
    ZERO3_RUN_ENV,
    ZERO3_STEPS,
    FourRankGlooTestCase,
    GlooTestCase,
    full_params,
    subprocess_env,
    torchrun,
    with_comms,
)
from _runs import assert_export_matches, run_config, run_overrides
from trainfit.models import build_model, materialize
from trainfit.models.hf import load_hf_weights
from trainfit.train import checkpoint as ckpt
from trainfit.train.distributed import World
from trainfit.train.metrics import read_metrics
from trainfit.train.sample import export_to_hf
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
    assert any("saved by 2 ranks, resharded to 1" in note for note in trainer.notes)
    result = trainer.train()
    assert_same_losses(result.losses, logged_losses(run_dir), range(4, ZERO3_STEPS + 1))


def test_export_of_a_sharded_checkpoint(zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path) -> None:
    run_dir, _ = zero3_run
    assert_export_matches(run_dir / "ckpt", tmp_path / "hf")


def test_zero1_run_trains_as_zero3_does_and_resumes_on_one_process(
        zero1_run: tuple[Path, subprocess.CompletedProcess], zero3_run: tuple[Path, subprocess.CompletedProcess],
        tmp_path: Path) -> None:
    run_dir, proc = zero1_run
    assert "2 processes: ZeRO-1 (sharded master" in proc.stdout  # the rest wraps in the summary table
    assert_same_losses(logged_losses(run_dir), logged_losses(zero3_run[0]), range(1, ZERO3_STEPS + 1))
    shards = sorted(p.name for p in (run_dir / "ckpt" / "step_00000003" / ckpt.DCP_DIR).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # both ranks wrote their shards
    saved = run_dir / "ckpt" / "step_00000003"
    trainer = Trainer(run_config(tmp_path, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                 f"--checkpoint.resume={saved}"))
    assert trainer.step == 3 and any("saved by 2 ranks, resharded to 1" in note for note in trainer.notes)
    assert_same_losses(trainer.train().losses, logged_losses(run_dir), range(4, ZERO3_STEPS + 1))


@pytest.mark.usefixtures("zero3_run_env", "zero1_run_env")
class CrossLayout(GlooTestCase):
    """2 ranks: ZeRO-1 resumes ZeRO-3's and one process's checkpoints, ZeRO-3 resumes ZeRO-1's; a
    ZeRO-1 bf16-mixed checkpoint exports its fp32 master weights."""

    @with_comms
    def test_resume_across_layouts_and_export(self) -> None:
        torch.set_num_threads(1)  # one per rank: the ranks share the machine's cores
        self.run_subtests({"case": [(ZERO1_RUN_ENV, 3), (ZERO3_RUN_ENV, 1), ("one process", 1)]},
                          lambda case: self._resume(*case))
        self._export_writes_the_fp32_masters()

    def _resume(self, saved_by: str, stage: int) -> None:
        """Resume step 3 of a run saved by `saved_by` with zero_stage=`stage`; steps 4-6 log the
        uninterrupted ZeRO-1 run's losses (every fp32 layout trains the same)."""
        zero1_run = Path(os.environ[ZERO1_RUN_ENV])
        if saved_by == "one process":
            saved = self.shared_dir / "one-process"
            if self.rank == 0:  # 3 steps of a 6-step schedule, then a checkpoint
                single = Trainer(run_config(saved, *DP_BATCH, f"--training.steps={ZERO3_STEPS}",
                                            "--training.micro_batch_size=8"),
                                 world=World())
                for _ in range(3):
                    single.train_step()
                single.save()
            torch.distributed.barrier()
            checkpoint = saved / "ckpt" / "step_00000003"
        else:
            checkpoint = Path(os.environ[saved_by]) / "ckpt" / "step_00000003"
        trainer = Trainer(run_config(self.shared_dir / f"resume-{stage}-{saved_by}", *DP_BATCH,
                                     f"--parallel.zero_stage={stage}",
                                     f"--training.steps={ZERO3_STEPS}", f"--checkpoint.resume={checkpoint}"))
        self.assertEqual(trainer.step, 3)
        result = trainer.train()
        if self.rank == 0:
            assert_same_losses(result.losses, logged_losses(zero1_run), range(4, ZERO3_STEPS + 1))

    def _export_writes_the_fp32_masters(self) -> None:
        """`trainfit export` of a ZeRO-1 bf16-mixed checkpoint: the fp32 masters, not the bf16
        parameters the ranks computed with."""
        run_dir = self.shared_dir / "zero1-bf16"
        trainer = Trainer(run_config(run_dir, *DP_BATCH, "--parallel.zero_stage=1", "--precision.mode=bf16-mixed",
                                     "--training.steps=2"))
        trainer.train()  # saves at its end
        masters = full_params(trainer)
        compute = {name: p.detach() for name, p in trainer.model.named_parameters()}
        if self.rank != 0:
            return
        self.assertEqual(compute["output.weight"].dtype, torch.bfloat16)
        export_to_hf(str(run_dir / "ckpt"), str(run_dir / "hf"))
        cfg = trainer.cfg
        exported = materialize(build_model(cfg.model), "cpu")
        load_hf_weights(exported, cfg.model, run_dir / "hf")
        for name, value in exported.state_dict().items():
            if name in masters:
                self.assertTrue(torch.equal(value, masters[name]), name)
        self.assertFalse(torch.equal(exported.output.weight, compute["output.weight"].float()))
        self.assertTrue(torch.equal(exported.output.weight.bfloat16(), compute["output.weight"]))


@pytest.mark.usefixtures("zero3_run_env")
class FourRanks(FourRankGlooTestCase):
    """HSDP (2 replicas x 2 shards) trains like one process and resumes the 2-rank checkpoint, as
    ZeRO-3 and as ZeRO-1 (its shards all-reduced across the replicas)."""

    @with_comms
    def test_hsdp(self) -> None:
        self.run_subtests({"case": ["hsdp", "zero1-replicated", "resume", "resume-zero1-replicated"]}, self._check)

    def _check(self, case: str) -> None:
        layout = ("--hardware.num_gpus=4", "--parallel.dp_replicate=2", "--training.micro_batch_size=1")
        if case == "hsdp":
            self.check_parity((*layout, "--parallel.zero_stage=3"), FP32)
        elif case == "zero1-replicated":  # optimizer states split within each replica
            self.check_parity((*layout, "--parallel.zero_stage=1"), FP32)
        else:
            stage = 1 if case == "resume-zero1-replicated" else 3
            run_dir = Path(os.environ[ZERO3_RUN_ENV])
            trainer = Trainer(run_config(self.shared_dir / case, *DP_BATCH, *layout, f"--parallel.zero_stage={stage}",
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
