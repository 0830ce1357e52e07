"""`trainfit train --profile=STEPS` on one process and `trainfit report --profile`: the trace is
written, parses, and its summary has compute and no communication (the 2-rank run, with
communication, is tests/distributed/test_profile_ranks.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _runs import run_config
from trainfit.cli import main
from trainfit.perf.trace import load_profiles
from trainfit.train.trainer import Trainer


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 steps, the third profiled; an earlier 2-rank run's rank-1 trace lies in the folder."""
    run_dir = tmp_path_factory.mktemp("profiled")
    stale = run_dir / "logs" / "profile" / "rank1.pt.trace.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    trainer = Trainer(run_config(run_dir, "--training.steps=3", "--logging.profile_steps=3"))
    try:
        trainer.train()
    finally:
        trainer.close()
    return run_dir / "logs" / "profile"


def test_one_process_trace_has_compute_and_no_communication(profiled_run: Path) -> None:
    assert sorted(p.name for p in profiled_run.iterdir()) == ["rank0.pt.trace.json"]  # the stale rank 1 removed
    [profile] = load_profiles(profiled_run)
    assert (profile.rank, profile.world_size, profile.device, profile.steps) == (0, 1, "cpu", [3])
    assert 0 < profile.compute_us <= profile.wall_us
    assert profile.comm_us == profile.exposed_comm_us == 0
    assert profile.compute_us + profile.idle_us == pytest.approx(profile.wall_us)
    assert profile.memory_growth_bytes > 0  # profile_memory recorded the step's allocations
    ops = {op.name: op for op in profile.ops}
    assert ops["aten::mm"].calls > 0 and ops["aten::mm"].self_us > 0
    assert "PythonDispatchMode" not in ops  # step 3 is a plain step, not the memory meter's


def test_report_prints_the_table_and_draws_the_timeline(profiled_run: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "trainfit", "report", "--profile", str(profiled_run)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "profiled step(s) 3 per rank" in proc.stdout and "exposed" in proc.stdout and "aten::mm" in proc.stdout
    assert f"wrote {profiled_run / 'timeline.png'}" in proc.stdout
    assert (profiled_run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([sys.executable, "-m", "trainfit", "report", "--json", "--profile",
                           str(profiled_run / "rank0.pt.trace.json"), "--plot", str(profiled_run / "t.svg")],
                          capture_output=True, text=True)
    [rank] = json.loads(proc.stdout)["ranks"]
    assert rank["compute_us"] > 0 and rank["ops"][0]["self_us"] > 0
    assert (profiled_run / "t.svg").exists()


@pytest.mark.parametrize("args, message", [
    (["train", "--profile=0"], "logging.profile_steps='0': give one step (3) or a range (3-5)"),
    (["train", "--profile=2-x"], "logging.profile_steps='2-x'"),
    (["train", "--profile=3", "--training.steps=2"], "within 1..training.steps=2"),
    (["report", "--profile", "nowhere"], "--profile 'nowhere': does not exist"),
    (["report", "x.toml", "--profile", "nowhere"], "takes no config; drop x.toml"),
])
def test_bad_profile_arguments_are_named(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err
