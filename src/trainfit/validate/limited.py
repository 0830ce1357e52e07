"""A command in a process group of its own, killed with its children at a time limit: how `trainfit
validate` and benchmarks/gpu_check.py run each entry, so that a hung or crashed one ends alone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def run_with_limit(cmd: list[str], env: dict[str, str], limit_s: float, stdout: Path, stderr: Path | None = None,
                   cwd: Path | None = None) -> tuple[int | None, float]:
    """(exit code, or None when the limit killed it; seconds) of `cmd`, its stdout written to `stdout`
    and its stderr to `stderr` (None: into stdout)."""
    start = time.monotonic()
    with open(stdout, "w") as out, open(stderr or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err if stderr else subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.monotonic() - start
