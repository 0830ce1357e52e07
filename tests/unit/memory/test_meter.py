"""The memory meter (memory/measured/attribution.py) wraps a step it did not build: any callable with the
step's listener hooks, here a hand-written step of a small MLP; on a trainer's own step it is the
same meter the trainer's loop uses."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from _runs import run_config
from trainfit.memory import PHASES
from trainfit.memory.measured import MemoryMeter
from trainfit.precision import precision_policy
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

DIM, HIDDEN, ROWS = 64, 512, 32


class HandWrittenStep:
    """A training step trainfit did not build: an MLP, AdamW, one batch, the four moments."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.model = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), foreach=False)
        self.policy = precision_policy("fp32", "cpu")
        self.inputs = torch.randn(ROWS, DIM, generator=generator)
        self.targets = torch.randn(ROWS, DIM, generator=generator)
        self.listeners: list[Callable[[str], None]] = []

    @contextlib.contextmanager
    def listening(self, listener: Callable[[str], None]) -> Iterator[None]:
        self.listeners.append(listener)
        try:
            yield
        finally:
            self.listeners.remove(listener)

    def _hear(self, moment: str) -> None:
        for listener in self.listeners:
            listener(moment)

    def __call__(self) -> float:
        self._hear("forward")
        loss = nn.functional.mse_loss(self.model(self.inputs), self.targets)
        self._hear("backward")
        loss.backward()
        self._hear("optimizer")
        self._hear("update")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def test_the_meter_measures_a_step_it_did_not_build() -> None:
    step = HandWrittenStep()
    meter = MemoryMeter(torch.device("cpu"))
    first = meter.watch(step)  # the warm-up: AdamW's states appear, known to the meter
    loss, m = meter.measure(step)
    assert isinstance(first, float) and isinstance(loss, float) and loss < first  # the step's own result
    b = m.breakdown
    param_bytes = 4 * sum(p.numel() for p in step.model.parameters())
    assert b.params == param_bytes == m.state_bytes["params"] == m.state_bytes["grads"]
    assert b.grads == param_bytes  # the peak comes with every gradient in (the optimizer's phase)
    assert b.optimizer == m.state_bytes["optimizer"] >= 2 * param_bytes  # exp_avg, exp_avg_sq (+ step counts)
    assert sum(b.components().values()) == b.peak and set(b.phase_peaks) == set(PHASES)
    assert m.forward_retained >= ROWS * HIDDEN * 4  # the hidden activation, kept for backward
    assert step.listeners == []  # detached after the step
    held = weakref.ref(step.model)
    del step
    gc.collect()
    assert held() is None  # the meter keeps no reference to the step


def test_a_fresh_meter_on_a_trainers_step_measures_what_the_trainers_loop_does(tmp_path: Path) -> None:
    """The trainer meters its TrainStep with the same meter; one built outside it agrees, component by component."""
    own, other = (Trainer(run_config(tmp_path / name), world=World()) for name in ("own", "other"))
    try:
        own.watched_step()
        by_loop = own.measured_step()
        meter = MemoryMeter(other.device, other.layout, memory_floor=other.memory_floor)
        meter.watch(other.stepper)
        stats, m = meter.measure(other.stepper)
    finally:
        own.close()
        other.close()
    assert by_loop.memory is not None and stats.loss == by_loop.loss
    assert m.breakdown.components() == by_loop.memory.components() and m.state_bytes == by_loop.state_bytes
    assert m.breakdown.phase_peaks == by_loop.memory.phase_peaks
