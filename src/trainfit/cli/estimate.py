"""`trainfit estimate`: per-GPU memory, FLOPs, step time and MFU of one config, and the fewest
changes that make it fit when it does not (torch-free unless --traced)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from trainfit.configure import read_config

if TYPE_CHECKING:
    from trainfit.config import Config
    from trainfit.parallel.layout import Layout


def cmd_estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.estimate import estimate, with_traced_memory
    from trainfit.estimate.report import plot_breakdown, print_estimate
    from trainfit.figures import check_figure_path
    from trainfit.plan.answer import estimate_answer
    from trainfit.plan.fixes import fewest_changes, method_changes
    from trainfit.plan.space import with_global_batch
    from trainfit.tables import say_derived

    _, cfg, derived = read_config(args.config, overrides)
    if args.plot:
        check_figure_path("--plot", args.plot)
    layout = _layout_of(cfg)
    est = estimate(cfg, layout)
    for message in est.layout.ineffective_options():  # as `trainfit train` warns of them
        print(f"warning: {message}", file=sys.stderr)
    if layout.rows is not None:
        print(f"note: {layout.rows.note(cfg.training.seq_len)}", file=sys.stderr)
    if args.traced:
        from trainfit.traced import trace_step

        est = with_traced_memory(est, trace_step(cfg, layout))
    if args.json:
        out = estimate_answer(cfg, est, derived=derived)
        out.pop("warnings")  # said on stderr above
        if args.traced:
            out["timeline"] = [list(point) for point in est.memory.timeline]
        print(json.dumps(out, indent=2))
    else:
        # the fixes keep the global batch: when it is 0, the one this config's run derives (named in the output)
        fixable, batch = with_global_batch(cfg)
        fixes = [] if est.fits else fewest_changes(fixable)
        methods = [] if est.fits else method_changes(fixable, fixes)
        if derived:
            say_derived(derived)
        print_estimate(est, fixes=fixes, fixes_batch=None if est.fits else batch, methods=methods)
        if args.traced:
            print(f"traced in {est.memory.seconds:.1f} s ({est.memory.num_ops:,} operators, peak in "
                  f"{est.memory.peak_module!r}); estimating process peak RSS "
                  f"{est.memory.peak_rss_bytes / 2**30:.2f} GiB")
    if args.plot:
        path = plot_breakdown(est, args.plot)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _layout_of(cfg: Config) -> Layout:
    """The config's layout, its fine-tuning rows looked up in the runs' cache too when data.path names records
    a run has tokenized (build_layout reads prepared folders only: train/data.sample_rows_of)."""
    import dataclasses

    from trainfit.parallel.resolve import build_layout

    layout = build_layout(cfg)
    if layout.rows is None and cfg.data.path:
        from trainfit.train.data import sample_rows_of

        layout = dataclasses.replace(layout, rows=sample_rows_of(cfg.data, cfg.model.init_from))
    return layout
