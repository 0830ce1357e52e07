"""`trainfit plan`: search the layouts of a cluster that fit and rank them by predicted step time,
or (--tokens) compare devices and counts by time to train and cost (torch-free unless --traced)."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from trainfit.config import Config, ConfigError, check_writable
from trainfit.parallel.resolve import GlobalBatch


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.config import write_atomic
    from trainfit.configure import config_from_dict, config_of_raw, read_raw, resolve_and_validate
    from trainfit.figures import check_figure_path
    from trainfit.plan.answer import fixed_fields, no_fit_message
    from trainfit.plan.explain import plan_json, plan_table, plot_plan, search_summary, winner_toml
    from trainfit.plan.search import search
    from trainfit.plan.space import with_global_batch
    from trainfit.tables import print_table
    from trainfit.units import fmt_bytes

    raw = read_raw(args.config, overrides)
    cfg, derived = config_of_raw(raw)
    if derived:
        from trainfit.tables import say_derived

        say_derived(derived, stderr=args.json)
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: show at least 1 candidate; try --top 10")
    if not 0 <= args.traced <= args.top:
        raise ConfigError(f"--traced {args.traced}: re-check between 0 and --top={args.top} candidates; try --traced 3")
    if args.plot:
        check_figure_path("--plot", args.plot)
    if args.out:
        check_writable("--out", args.out)
    precisions = tuple(p for p in (args.precisions or "").split(",") if p)
    for mode in precisions:
        cfg_check = config_from_dict({**raw, "precision": {**raw.get("precision", {}), "mode": mode}})
        resolve_and_validate(cfg_check)  # names precision.mode and the valid modes when one is wrong
    fixed = fixed_fields(raw)
    # A plan keeps the global batch; when it is 0, the one `trainfit train` derives from the config as given
    # (search and compare_machines derive it the same way).
    _, batch = with_global_batch(cfg)
    if args.tokens is not None:
        return _plan_machines(args, cfg, fixed, batch)
    out = sys.stderr if args.json else sys.stdout
    _say_derived(batch, out)
    plan = search(cfg, fixed, top=args.top, precisions=precisions, exhaustive=bool(args.plot))
    if not plan.candidates and not plan.stats.groups:
        from trainfit.parallel.resolve import build_layout

        build_layout(cfg)  # no layout was even valid: the config's own fields say why (a named error)
    if not plan.candidates:
        print(f"error: {no_fit_message(cfg, plan, batch)}", file=sys.stderr)
        return 1
    checks = _traced_checks(plan.candidates[:args.traced]) if args.traced else []
    if args.json:
        out_json = plan_json(plan)
        for row, check in zip(out_json["candidates"], checks, strict=False):
            row["traced_memory_bytes"] = check
        print(json.dumps(out_json, indent=2))
    else:
        from rich.console import Console

        console = Console()
        print_table(plan_table(plan), console)
        console.print(search_summary(plan))
        for i, (c, traced) in enumerate(zip(plan.candidates, checks, strict=False)):
            verdict = "fits" if not c.device_memory or traced <= c.device_memory else "DOES NOT FIT"
            console.print(f"traced #{i + 1}: {fmt_bytes(traced)} per GPU against the analytic "
                          f"{fmt_bytes(c.memory_bytes)} ({traced / c.memory_bytes - 1:+.1%}): {verdict}")
    if args.out:
        write_atomic(args.out, winner_toml(raw, plan.candidates[0]))
        print(f"wrote {args.out}: the fastest layout as a config (trainfit train {args.out})", file=out)
    if args.plot:
        print(f"wrote {plot_plan(plan, args.plot)}", file=out)
    return 0


def _plan_machines(args: argparse.Namespace, cfg: Config, fixed: frozenset[str], batch: GlobalBatch) -> int:
    """`trainfit plan --tokens N`: each device of --gpu-options at each count up to --max-gpus, its
    fastest layout, time to train and cost, all at one global batch (`batch`: cfg's, derived when 0)."""
    import json

    from rich.console import Console
    from rich.progress import Progress

    from trainfit.plan.explain import machines_json, machines_table, plot_machines
    from trainfit.plan.machines import check_gpus, compare_machines, parse_prices
    from trainfit.tables import print_table

    if not args.tokens > 0:
        raise ConfigError(f"--tokens {args.tokens}: the tokens to train on, > 0 (e.g. 2e12)")
    gpus = check_gpus([g for g in (args.gpu_options or cfg.hardware.gpu).split(",") if g])
    max_gpus = cfg.hardware.num_gpus if args.max_gpus is None else args.max_gpus
    if max_gpus < 1:
        raise ConfigError(f"--max-gpus {args.max_gpus}: must be >= 1")
    if args.out or args.traced:
        raise ConfigError("--tokens compares devices and counts; --out and --traced go with one cluster (drop "
                          "--tokens and set --hardware.gpu and --hardware.num_gpus)")
    _say_derived(batch, sys.stderr if args.json else sys.stdout)
    err = Console(stderr=True)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("planning", total=None)
        options = compare_machines(cfg, fixed, tokens=args.tokens, gpus=gpus, max_gpus=max_gpus,
                                   prices=parse_prices(args.prices),
                                   progress=lambda what: bar.update(task, description=f"planning {what}"))
    if args.json:
        print(json.dumps({**machines_json(options), "global_batch": batch.as_dict()}, indent=2))
    else:
        print_table(machines_table(options, args.tokens))
    if args.plot:
        print(f"wrote {plot_machines(options, args.plot)}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _say_derived(batch: GlobalBatch, out: TextIO) -> None:
    """A plan's note, when the config leaves the global batch at 0, of the batch it derived and kept."""
    if batch.derived:
        print(f"global batch: {batch.words()}, as trainfit train derives it; set training.global_batch_size to plan "
              "another", file=out)


def _traced_checks(candidates: list) -> list[int]:
    """The traced estimator's memory per GPU (its worst stage's peak plus the analytic reserved
    margin, as `estimate --traced` counts it) of each candidate, in order."""
    from trainfit.estimate import estimate, with_traced_memory
    from trainfit.traced import trace_step

    checks = []
    for i, c in enumerate(candidates):
        print(f"tracing candidate {i + 1} of {len(candidates)} ...", file=sys.stderr)
        traced = with_traced_memory(estimate(c.cfg, c.layout), trace_step(c.cfg, c.layout))
        checks.append(traced.memory_bytes)
    return checks
