"""`trainfit report`: the analytic and traced predictions against a measured step, or (--profile)
the per-rank summary of a `trainfit train --profile` run's traces."""

from __future__ import annotations

import argparse
import sys

from trainfit.cli.common import check_steps
from trainfit.config import ConfigError
from trainfit.configure import load_config


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.tables import print_table
    if args.profile:  # reads traces only: no torch
        return _report_profile(args, overrides)
    import json

    from trainfit.estimate import estimate
    from trainfit.figures import check_figure_path
    from trainfit.memory import Comparison, comparison_table, plot_comparison
    from trainfit.traced import trace_step
    from trainfit.train.trainer import measure_step

    cfg = load_config(args.config, overrides)
    check_steps(args.steps)
    if args.plot:
        check_figure_path("--plot", args.plot)
    traced = trace_step(cfg)  # before measuring: tracing needs the process-group slot free
    measured = measure_step(cfg, steps=args.steps)
    cmp = Comparison({"analytic": estimate(cfg).worst, "traced": traced.worst, "measured": measured.breakdown},
                     {"traced": traced.timeline, "measured": measured.timeline})
    if args.json:
        print(json.dumps(cmp.as_dict(), indent=2))
    else:
        print_table(comparison_table(cmp))
    if args.plot:
        print(f"wrote {plot_comparison(cmp, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _report_profile(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainfit report --profile TRACE`: the per-rank table of a `trainfit train --profile` run and
    its timeline picture (--plot, default timeline.png beside the traces)."""
    import importlib.util
    import json
    from pathlib import Path

    from rich.console import Console

    from trainfit.figures import check_figure_path
    from trainfit.perf.trace import load_profiles
    from trainfit.perf.trace_report import operator_table, plot_timeline, time_table
    from trainfit.tables import print_table

    if args.config or overrides:
        raise ConfigError(f"--profile {args.profile!r} summarises traces and takes no config; drop "
                          f"{' '.join(filter(None, [args.config, *overrides]))}")
    trace = Path(args.profile)
    plot = args.plot or str((trace if trace.is_dir() else trace.parent) / "timeline.png")
    check_figure_path("--plot", plot)
    if importlib.util.find_spec("matplotlib") is None:
        if args.plot:
            raise ConfigError("--plot needs matplotlib: pip install 'trainfit[plot]'")
        plot = ""
    profiles = load_profiles(trace)
    out = sys.stderr if args.json else sys.stdout
    if args.json:
        print(json.dumps({"ranks": [p.as_dict() for p in profiles]}, indent=2))
    else:
        console = Console()
        print_table(time_table(profiles), console)
        print_table(operator_table(profiles), console)
    missing = sorted(set(range(profiles[0].world_size)) - {p.rank for p in profiles})
    if missing:
        print(f"warning: no trace of rank(s) {', '.join(map(str, missing))} of {profiles[0].world_size}", file=out)
    if plot:
        print(f"wrote {plot_timeline(profiles, plot)}", file=out)
    else:
        print("no timeline picture: it needs matplotlib (pip install 'trainfit[plot]')", file=out)
    return 0
