"""SIGTERM / SIGINT during training: finish the current step, save, exit cleanly.

A second signal stops at once: Ctrl-C raises KeyboardInterrupt (the CLI exits 130), SIGTERM gets
its default action; checkpoints are written atomically, so the last one stays intact.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # the second signal: stop now, whatever handler the process started with
            if signum == signal.SIGINT:  # (a job started in the background inherits SIGINT ignored)
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
