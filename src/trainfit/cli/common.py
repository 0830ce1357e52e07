"""Checks that more than one command makes of its own options."""

from __future__ import annotations

from trainfit.config import ConfigError


def check_steps(steps: int) -> None:
    """`--steps` of measure and report."""
    if steps < 2:
        raise ConfigError(f"--steps {steps}: measure at least 2 steps (the first one warms up); try --steps 2")


def reject_overrides(overrides: list[str]) -> None:
    """The commands that read no config (sample, export, prepare-data, calibrate) take no --section.field."""
    if overrides:
        raise ConfigError(f"unexpected arguments {overrides}: this command takes no config overrides")
