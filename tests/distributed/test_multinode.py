"""Beyond one machine: a two-node launch (two torchrun invocations meeting at a rendezvous endpoint,
here both on localhost) trains exactly as one two-process node does, and an elastic restart
(`torchrun --max-restarts`) after a rank dies resumes from the last checkpoint and ends where an
uninterrupted run ends. docs/techniques/multi-node.md and examples/slurm.sbatch launch the same way."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _dist import DP_BATCH, ZERO3_LAYOUT, ZERO3_STEPS, subprocess_env
from _runs import run_overrides
from trainfit.train import checkpoint as ckpt
from trainfit.train.metrics import read_metrics


def losses(run_dir: Path) -> dict[int, float]:
    """The last loss logged for each step (a restarted run logs some steps twice)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "logs") if "loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_process_train_as_one_node_of_two(
        zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    run = tmp_path / "two-nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    args = run_overrides(run, *DP_BATCH, f"--training.steps={ZERO3_STEPS}", *ZERO3_LAYOUT)
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=trainfit-test",
                               "-m", "trainfit", "train", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=subprocess_env(tmp_path_factory))
             for _ in range(2)]
    outputs = [node.communicate()[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-2000:] for o in outputs)
    assert sum(o.count("run complete") for o in outputs) == 1  # one rank 0 across the nodes
    assert losses(run) == losses(zero3_run[0])  # bitwise: the same world, the same reductions


DIE_ONCE_AFTER_STEP_4 = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from trainfit.cli import main
    from trainfit.train.trainer import Trainer

    step = Trainer.train_step
    marker = Path(sys.argv[1])

    def step_then_die_once(self):  # rank 1 dies after step 4 (step 3 is saved), on the first attempt only
        stats = step(self)
        if self.step == 4 and os.environ["RANK"] == "1" and not marker.exists():
            marker.write_text("died")
            os._exit(1)
        return stats

    Trainer.train_step = step_then_die_once
    sys.exit(main(sys.argv[2:]))
""")


def test_an_elastic_restart_resumes_from_the_last_checkpoint(
        zero3_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """One restart allowed, and it must do: the restarted group meets in the agent's store under a
    prefix of its attempt (train/distributed.py's _attempt_rendezvous); without it, it read the dead
    attempt's gloo addresses there ("connection refused", or a hang on a busy machine)."""
    script = tmp_path / "die_once.py"
    script.write_text(DIE_ONCE_AFTER_STEP_4)
    run = tmp_path / "elastic"
    marker = tmp_path / "died"
    args = run_overrides(run, *DP_BATCH, f"--training.steps={ZERO3_STEPS}", *ZERO3_LAYOUT)  # saves every 3 steps
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "--max-restarts=1", str(script), str(marker), "train", *args],
                          capture_output=True, text=True, env=subprocess_env(tmp_path_factory))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert marker.exists()  # rank 1 did die, and the group was restarted
    said = (proc.stdout + proc.stderr).replace("\n", "")  # rich wraps the long path
    assert f"resumed from {run / 'ckpt' / ckpt.step_dir_name(3)} at step 3" in said
    assert losses(run) == losses(zero3_run[0])
