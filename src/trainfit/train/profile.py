"""`logging.profile_steps`: torch.profiler around chosen training steps, one trace per rank.

Every rank loads the same config, so every rank profiles the same steps and writes
<logging.dir>/profile/rank<r>.pt.trace.json: a Chrome trace (Perfetto, chrome://tracing) named the way
torch.profiler.tensorboard_trace_handler names its files, so TensorBoard's profiler plugin
(`tensorboard --logdir <logging.dir>`) lists it as run "profile", worker "rank<r>". Each profiled step
runs inside a `ProfilerStep#<step>` range, the name the profiler's own schedule gives steps: the
plugin's step view and perf/trace.py read the step boundaries from it.

Recorded: CPU operators (and CUDA kernels and memcpys on a GPU), input shapes, and every allocation
and free (profile_memory); no Python stacks (with_stack makes traces several times larger). The
profiler starts before the first chosen step and stops after the last, rather than following a
wait/warmup/active schedule: the window is given in steps, and no other step pays for the profiler.
On CUDA the allocator's history over the same steps is also dumped, by the code `trainfit measure`
uses (memory/measured/attribution.cuda_history), to rank<r>.memory_snapshot.pickle for pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from trainfit.config import Config
from trainfit.configure.validate import profile_window
from trainfit.memory.measured import cuda_history

TRACE_SUFFIX = ".pt.trace.json"
SNAPSHOT_SUFFIX = ".memory_snapshot.pickle"


def trace_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"rank{rank}{TRACE_SUFFIX}"


class StepProfiler:
    """Profiles training steps `window[0]..window[1]` (counted from 1) of this rank; `step(n)`
    wraps every step, and does nothing outside the window."""

    def __init__(self, window: tuple[int, int] | None, out_dir: str | Path, *, rank: int, world_size: int,
                 device: torch.device) -> None:
        self.window, self.out_dir, self.rank, self.device = window, Path(out_dir), rank, device
        self.world_size = world_size
        self._session = contextlib.ExitStack()
        self._profiler: profile | None = None
        self.written: list[Path] = []
        """The files this rank wrote when the window closed."""

    @classmethod
    def from_config(cls, cfg: Config, *, rank: int, world_size: int, device: torch.device) -> StepProfiler:
        """The run's profiler: `logging.profile_steps`, writing to <logging.dir>/profile."""
        return cls(profile_window(cfg.logging.profile_steps, cfg.training.steps), Path(cfg.logging.dir) / "profile",
                   rank=rank, world_size=world_size, device=device)

    def notes(self, started_at: int, instrumented: set[int]) -> list[str]:
        """What the log should say before training: profiled steps that will not run (a resumed
        run) or that the memory meter slows (`instrumented`: its watched and measured steps)."""
        if self.window is None:
            return []
        first, last = self.window
        if last <= started_at:
            return [f"logging.profile_steps={self.window_text}: the run starts at step {started_at + 1}, "
                    "after those steps; nothing is profiled"]
        slow = sorted(instrumented & set(range(max(first, started_at + 1), last + 1)))
        if not slow:
            return []
        return [f"profiling step(s) {', '.join(map(str, slow))}, which the memory meter watches or measures "
                "(slower; on CPU their collectives run one at a time): profile later steps for a plain step's time"]

    @property
    def window_text(self) -> str:
        assert self.window is not None
        first, last = self.window
        return str(first) if first == last else f"{first}-{last}"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Run training step `step` (its number once done: the trainer's step + 1)."""
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            yield
            return
        if self._profiler is None:
            self._start()
        with record_function(f"ProfilerStep#{step}"):
            yield
        if step == self.window[1]:
            self.close()

    def _start(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:  # an earlier run's traces of ranks this world does not have would mix in
            for old in self.out_dir.glob("rank*"):
                rank = old.name.removeprefix("rank").split(".")[0]
                if rank.isdigit() and int(rank) >= self.world_size:
                    old.unlink()
        cuda = self.device.type == "cuda"
        self._session.enter_context(cuda_history(self.out_dir / f"rank{self.rank}{SNAPSHOT_SUFFIX}" if cuda else None))
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self._profiler = self._session.enter_context(
            profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=False))

    def close(self) -> None:
        """Stop and write the trace (and the CUDA snapshot); also what a run stopped inside the
        window (signal, divergence) calls, so the steps it profiled are kept."""
        if self._profiler is None or self.written:
            return
        profiler, cuda = self._profiler, self.device.type == "cuda"
        self._session.close()  # stops the profiler, then dumps the CUDA snapshot
        path = trace_path(self.out_dir, self.rank)
        profiler.export_chrome_trace(str(path))
        self.written = [path, *([self.out_dir / f"rank{self.rank}{SNAPSHOT_SUFFIX}"] if cuda else [])]
