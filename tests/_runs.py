"""The one way tests configure a run: `run_overrides` / `run_config` (a quiet run writing only under a
temp folder), and seeded models."""

from __future__ import annotations

from pathlib import Path

import torch

from trainfit.config import Config, ModelConfig, load_config
from trainfit.models import build_model, materialize

DEBUG_RUN = ("--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=4",
             "--training.global_batch_size=4", "--training.warmup_steps=2")
"""The run `run_overrides` starts from unless told otherwise: the debug model on 32-token sequences, one
micro-batch of 4 rows per step (one process), a 2-step warm-up."""


def run_overrides(run_dir: Path, *overrides: str, base: tuple[str, ...] = DEBUG_RUN) -> list[str]:
    """Overrides for a quiet run of `base` writing only under run_dir: no evaluation, a checkpoint at the
    end only, metrics every step, no progress bar. `overrides` come last and win; `base=()` keeps the
    default config's model and batch (rows of the accuracy grid give their whole shape)."""
    return [*base, "--training.eval_interval=0", "--checkpoint.interval=0", f"--checkpoint.dir={run_dir / 'ckpt'}",
            f"--logging.dir={run_dir / 'logs'}", "--logging.progress=false", "--logging.interval=1", *overrides]


def run_config(run_dir: Path, *overrides: str, base: tuple[str, ...] = DEBUG_RUN) -> Config:
    """The Config of `run_overrides(run_dir, *overrides, base=base)`."""
    return load_config(None, run_overrides(run_dir, *overrides, base=base))


def seeded_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A materialized model whose weights depend on `seed` only."""
    return materialize(build_model(cfg), "cpu", seed)
