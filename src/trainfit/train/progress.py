"""The progress bar of `trainfit train`: step, loss, tokens/s and ETA (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("step"), MofNCompleteColumn(), BarColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"), TimeRemainingColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                             loss="-", tps="-")

    def __enter__(self) -> TrainProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")

    def note(self, message: str) -> None:
        """A line printed above the bar (validation losses, signals)."""
        if self.enabled:
            self._progress.console.print(message)
