"""The analytic estimator called on a whole config, as tests write their cases (the library's
functions take the sections and a Layout, so that the planner can call them without a Config)."""

from __future__ import annotations

from trainfit.config import Config
from trainfit.memory import MemoryBreakdown
from trainfit.memory.closed_form import analytic
from trainfit.parallel.layout import Layout
from trainfit.parallel.resolve import build_layout


def _args(cfg: Config, layout: Layout | None) -> tuple:
    return cfg.model, layout or build_layout(cfg), cfg.training, cfg.hardware, cfg.optimizer


def memory_of(cfg: Config, layout: Layout | None = None) -> analytic.MemoryEstimate:
    return analytic.estimate_memory(*_args(cfg, layout))


def states_of(cfg: Config, layout: Layout | None = None, stage: int = 0) -> MemoryBreakdown:
    return analytic.model_states(*_args(cfg, layout), stage=stage)


def retained_of(cfg: Config, layout: Layout | None = None, stage: int = 0) -> int:
    return analytic.forward_retained_bytes(*_args(cfg, layout), stage=stage)
