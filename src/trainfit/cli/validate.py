"""`trainfit validate`: the predictions against measured steps on this machine (trainfit/validate/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainfit.cli.common import reject_overrides
from trainfit.config import ConfigError, check_writable


def cmd_validate(args: argparse.Namespace, overrides: list[str]) -> int:
    from rich.console import Console

    from trainfit.validate.run import validate

    reject_overrides(overrides)
    check_writable("--out", args.out)
    if args.budget_s <= 0:
        raise ConfigError(f"--budget-s {args.budget_s:g}: must be > 0 (seconds for the whole run; default 450)")
    only = [n.strip() for n in (args.only or "").split(",") if n.strip()]
    if args.only is not None and not only:
        raise ConfigError(f"--only {args.only!r}: names no entry; give comma-separated names, or leave it out")
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no terminal width to fit, so the table is not squeezed
        console = Console(width=160)
    return validate(device=args.device, out=Path(args.out), budget_s=args.budget_s, only=only, console=console)
