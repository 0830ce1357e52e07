"""`trainfit measure`: run real steps and measure the last one's memory at the allocator, per component."""

from __future__ import annotations

import argparse

from trainfit.cli.common import check_steps
from trainfit.configure import load_config


def cmd_measure(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.estimate import as_json, estimate
    from trainfit.memory import Comparison, comparison_table
    from trainfit.tables import print_table
    from trainfit.train.trainer import measure_step

    cfg = load_config(args.config, overrides)
    check_steps(args.steps)
    measured = measure_step(cfg, steps=args.steps)
    est = estimate(cfg)
    if args.json:
        out = as_json(est)
        stage = {"stage": 0, **measured.breakdown.as_dict(), "device": measured.device, "rank": measured.rank}
        print(json.dumps({"model": out["model"], "per_rank": stage, "per_stage": [stage]}, indent=2))
    else:

        print_table(comparison_table(Comparison({"measured": measured.breakdown}), "memory measured per rank"))
    return 0
