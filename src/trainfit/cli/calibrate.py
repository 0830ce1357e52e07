"""`trainfit calibrate`: measure this machine (matmuls, memory bandwidth, collectives, the optimizer
step) into a hardware profile that estimate and train read with --hardware.profile."""

from __future__ import annotations

import argparse
import sys

from trainfit.cli.common import reject_overrides
from trainfit.config import ConfigError, check_writable
from trainfit.hardware_profile import is_profile

PROFILE = ("hardware profile", is_profile)
"""What --out may replace: a profile (calibrate's own kind of file), never another file."""


def cmd_calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.tables import print_table
    if args.catalog:
        return _write_catalog(args, overrides)
    import json

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trainfit.calibrate.machine import calibrate, profile_tables, resolve_max_ranks
    from trainfit.hardware_profile import write_profile

    reject_overrides(overrides)
    check_writable("--out", args.out, replace=args.force, kind=PROFILE)
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads {args.threads}: must be >= 1 (default: what torch uses here, "
                          f"{torch.get_num_threads()})")
    max_ranks = resolve_max_ranks(args.max_ranks)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    err = Console(stderr=True)
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("calibrating", total=None)
        profile = calibrate(quick=args.quick, max_ranks=max_ranks, threads=args.threads or torch.get_num_threads(),
                            progress=lambda what, done, total: bar.update(task, description=what, completed=done,
                                                                          total=total))
    write_profile(profile, args.out)
    if args.json:
        print(json.dumps(profile.as_dict(), indent=2))
    else:
        console = Console()
        for table in profile_tables(profile):
            print_table(table, console)
    print(f"wrote {args.out}: use it as trainfit estimate --hardware.profile={args.out}",
          file=sys.stderr if args.json else sys.stdout)
    return 0


def _write_catalog(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainfit calibrate --catalog GPU`: the catalog's published figures for GPU as a profile; no torch."""
    from trainfit.calibrate.catalog import catalog_profile, sources
    from trainfit.config import write_atomic
    from trainfit.config.dump import dump_toml

    reject_overrides(overrides)
    check_writable("--out", args.out, replace=args.force, kind=PROFILE)
    profile = catalog_profile(args.catalog)
    write_atomic(args.out, dump_toml(profile.as_dict(), sources(args.catalog)))
    print(f"wrote {args.out}: {args.catalog}'s catalog figures; use it as trainfit estimate "
          f"--hardware.gpu={args.catalog} --hardware.profile={args.out}")
    return 0
