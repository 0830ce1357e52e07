"""Kill test: SIGKILL a 2-rank ZeRO-3 run at random moments (mid-step, mid-save, at start-up),
rerun the same command each time, and check that every rerun resumes from the newest intact
checkpoint and that the run, once it finishes, is bit-identical to one never interrupted.

Each of the N trials starts `torchrun --standalone --nproc_per_node 2 -m trainfit train ...` in the
same run folder (checkpoint every step) and kills the whole process tree with SIGKILL at one of
three moments, in turn: during start-up (a random delay before the first step), mid-step (after a
random number of trained steps, a random fraction of a step later) and mid-save (after a random
number of trained steps, the moment the next save's temp folder appears). Before every restart it
records the newest checkpoint whose manifest verifies; the restart's "resumed from" note must name
it. After N kills the run is left to finish; its losses (the last one logged for each step) and
final weights must equal the uninterrupted run's exactly.

    python benchmarks/kill_test.py [--trials 20] [--steps 600] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trainfit.train import checkpoint as ckpt
from trainfit.train.metrics import read_metrics


def command(run: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainfit",
            "train", "--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=2",
            "--training.global_batch_size=8", f"--training.steps={steps}", "--training.warmup_steps=2",
            "--training.eval_interval=0", "--parallel.zero_stage=3", "--checkpoint.interval=1",
            f"--checkpoint.dir={run / 'ckpt'}", f"--logging.dir={run / 'logs'}", "--logging.interval=1",
            "--logging.progress=true", "--logging.traced_estimate=false"]


def start(run: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.Popen(command(run, steps), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)


def newest_intact(root: Path) -> int:
    """The step of the newest checkpoint whose files verify (0: none)."""
    for path in reversed(ckpt.list_checkpoints(root)):
        if not ckpt.verify_checkpoint(path):
            return int(path.name.removeprefix(ckpt.STEP_PREFIX))
    return 0


class Output:
    """Reads a process's output on a thread of its own, so the test can watch the steps go by."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.thread.start()

    def steps_trained(self) -> int:
        return sum(line.startswith("step ") for line in list(self.lines))

    def text(self) -> str:
        self.thread.join()
        return "".join(self.lines)


MOMENTS = ("start-up", "mid-step", "mid-save")


def kill_at(moment: str, proc: subprocess.Popen, output: Output, run: Path, rng: random.Random) -> str:
    """Wait for this trial's moment, then SIGKILL the whole tree; returns where it was killed."""
    deadline = time.monotonic() + 120

    def wait_until(ready) -> None:
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.002)

    if moment == "start-up":
        time.sleep(rng.uniform(0.0, 4.0))  # start-up takes ~4-6 s here
        if output.steps_trained():
            moment = "mid-step"
    else:
        target = rng.randint(1, 12)
        wait_until(lambda: output.steps_trained() >= target)
        if moment == "mid-step":
            time.sleep(rng.uniform(0.0, 0.2))  # a step and its save take ~0.1-0.2 s here
        else:
            root = run / "ckpt"
            before = {p.name for p in root.glob(".tmp-*")}
            wait_until(lambda: bool({p.name for p in root.glob(".tmp-*")} - before))
        moment += f" (after {output.steps_trained()} steps)"
    if proc.poll() is not None:
        return "finished first"
    for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun starts its ranks in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    return moment


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def resumed_step(output: str) -> int | None:
    """Where a start resumed, from its output: the step of its "resumed from" note, 0 when it trained
    from scratch, None when it was killed before saying either (it wrote nothing then)."""
    for line in output.splitlines():
        if line.startswith("resumed from") and " at step " in line:
            return int(line.split(" at step ")[1].split()[0])
    return 0 if any(line.startswith("step ") for line in output.splitlines()) else None


def final_state(run: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run / "final.pt"
    dcp_to_torch_save(ckpt.latest_checkpoint(run / "ckpt") / ckpt.DCP_DIR, out)
    return torch.load(out, weights_only=True)["model"]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "logs") if "loss" in r}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=600)  # enough that every kill lands in a live run
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        reference, run = Path(tmp, "reference"), Path(tmp, "run")
        proc = start(reference, args.steps)
        out = proc.communicate()[0]
        if proc.returncode:
            console.print(out[-3000:])
            return 1
        table = Table(title=f"kill -9 of a 2-rank ZeRO-3 run, {args.trials} times, then the same command again")
        for name in ("kill", "where", "newest intact checkpoint after it", "the rerun resumed from", "ok"):
            table.add_column(name)
        rows: list[list[str]] = []
        pending: list[list[str]] = []  # kills whose rerun has not said where it resumed yet

        def verify(output: str, expected: int) -> None:
            resumed = resumed_step(output)
            if resumed is None:
                return  # killed during start-up: it wrote nothing, the next start is still the rerun
            for row in pending:
                row[2:] = [str(expected), str(resumed), "yes" if resumed == expected else "NO"]
            pending.clear()

        for trial in range(1, args.trials + 1):
            expected = newest_intact(run / "ckpt")
            proc = start(run, args.steps)
            output = Output(proc)
            where = kill_at(MOMENTS[trial % len(MOMENTS)], proc, output, run, rng)
            verify(output.text(), expected)
            row = [str(trial), where, "", "", ""]
            rows.append(row)
            pending.append(row)
        expected = newest_intact(run / "ckpt")
        final = start(run, args.steps)  # the last rerun, left to finish
        verify(final.communicate()[0], expected)
        for row in rows:
            table.add_row(*row)
        good = sum(row[4] == "yes" for row in rows)
        same_losses = losses(run) == losses(reference)
        a, b = final_state(run), final_state(reference)
        same_weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        console.print(table)
        console.print(f"resumed from the newest intact checkpoint: {good}/{args.trials}; final losses bit-identical "
                      f"to the uninterrupted run: {same_losses}; final weights bit-identical: {same_weights}")
        return 0 if good == args.trials and same_losses and same_weights else 1


if __name__ == "__main__":
    raise SystemExit(main())
