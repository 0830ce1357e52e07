"""The analytic memory model against real training steps of our own models, measured on CPU.

Each configuration of the grid (tests/estimator/_measure.py: precision x optimizer x activation
checkpointing x micro-batch x sequence length x model shape) builds trainfit's Trainer, warms up
one step, then measures one `train_step` at the allocator (glibc in-use bytes after every aten
operator). Within 10%, each of:
- activations: in use after forward + loss minus before it, against
  `analytic.forward_retained_bytes` (saved activations, log-probabilities and, with torch.amp,
  the saved 16-bit weight copies);
- model states: the parameter, gradient and optimizer-state tensors, against
  `analytic.model_states`;
- peak: the step's largest in-use bytes, against `estimate_memory(...).worst.peak`.
`python benchmarks/estimator_accuracy.py` prints the same grid as a table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _measure import GRID, config, grid_name, grid_overrides, measure_step, one_thread

from trainfit.memory.analytic import estimate_memory, forward_retained_bytes, model_states
from trainfit.train.trainer import Trainer

TOLERANCE = 0.10


def _check(name: str, predicted: int, measured: int) -> None:
    error = (predicted - measured) / measured
    assert abs(error) <= TOLERANCE, f"{name}: predicted {predicted:,} vs measured {measured:,} bytes ({error:+.1%})"


@pytest.mark.parametrize("row", GRID, ids=[grid_name(row) for row in GRID])
def test_analytic_matches_a_measured_step(row: tuple, tmp_path: Path) -> None:
    cfg = config(tmp_path, *grid_overrides(row))
    measured = measure_step(cfg)
    _check("activations", forward_retained_bytes(cfg), measured.activations)
    _check("model states", model_states(cfg).model_states, measured.model_states)
    _check("peak", estimate_memory(cfg).worst.peak, measured.peak)


def test_default_config_matches_the_peak_trainfit_train_reports(tmp_path: Path) -> None:
    """The default run (tiny preset, fp32, micro-batch 16, seq 128): `trainfit train` reports its
    measured step's peak above the heap before the model was built (~232 MiB in a fresh process,
    of which ~11 MiB are one-time library allocations; ~221 MiB once they exist)."""
    cfg = config(tmp_path)
    with one_thread():
        trainer = Trainer(cfg)
        trainer.train_step()
        reported = trainer.measured_step().peak_memory_bytes
    _check("peak", estimate_memory(cfg).worst.peak, reported)
