"""Helpers for tests that train: fast debug-model runs writing under a temp folder."""

from __future__ import annotations

from pathlib import Path

import torch

from trainfit.config import ModelConfig
from trainfit.models import build_model, materialize


def run_overrides(run_dir: Path, *extra: str) -> list[str]:
    """Overrides for a fast debug-model run writing only under run_dir."""
    return [
        "--model.preset=debug", "--training.seq_len=32", "--training.micro_batch_size=4",
        "--training.global_batch_size=4", "--training.warmup_steps=2", "--training.eval_interval=0",
        f"--checkpoint.dir={run_dir / 'ckpt'}", f"--logging.dir={run_dir / 'logs'}",
        "--logging.progress=false", *extra,
    ]


def seeded_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A materialized model whose weights depend on `seed` only."""
    return materialize(build_model(cfg), "cpu", seed)
