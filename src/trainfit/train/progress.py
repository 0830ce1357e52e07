"""The progress bar of `trainfit train`: step, loss, tokens/s and ETA (rich). Ranks other than 0
are quiet: one bar and one copy of every message per run. When the output is not a terminal (a
log file, a batch job), the bar cannot redraw: a plain line is printed every `line_every` steps."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None, *,
                 quiet: bool = False, line_every: int = 10) -> None:
        """enabled: show the bar (and notes); quiet: print nothing at all, not even announcements;
        line_every: steps between the plain lines printed instead of the bar off a terminal."""
        self.console = console or Console(stderr=True)
        self.enabled = enabled and not quiet
        self.quiet = quiet
        self.total_steps, self.line_every = total_steps, max(1, line_every)
        self._started = time.monotonic()
        self._start_step = start_step
        self._progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, disable=not self.enabled or not self.console.is_terminal, transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                             loss="-", tps="-")

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_s: float | None) -> None:
        """`tokens_per_s`: None until a step that is not instrumented (warm-up, memory, profile) ran."""
        tps = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=tps)
        if self.enabled and not self.console.is_terminal and (step % self.line_every == 0 or step == self.total_steps):
            done = step - self._start_step
            left = (time.monotonic() - self._started) / done * (self.total_steps - step) if done else 0.0
            self.console.print(f"step {step}/{self.total_steps} loss {loss:.4f} {tps} tok/s "
                               f"ETA {int(left) // 60}:{int(left) % 60:02d}", highlight=False)

    def note(self, message: str) -> None:
        """A line printed above the bar (validation losses, signals)."""
        if self.enabled:
            self._progress.console.print(message)

    def announce(self, message: str) -> None:
        """A line printed even without the bar: what changes the run (resume, schedule, signals)."""
        if not self.quiet:
            self._progress.console.print(message)
