"""The first SIGINT/SIGTERM asks the loop to stop after its step; a second stops at once, even in a
process that started with SIGINT ignored (a job launched in the background)."""

from __future__ import annotations

import signal

import pytest

from trainfit.train.signals import StopOnSignal


def test_a_second_ctrl_c_stops_at_once_even_when_sigint_was_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopOnSignal() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.requested and stop.signal_name == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # restored on the way out
    finally:
        signal.signal(signal.SIGINT, previous)
