"""The `trainfit` command: each subcommand parses its arguments, calls one library function and
prints the result; the work lives in the library.

Heavy imports (torch) happen inside the subcommands, so `trainfit --help` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import textwrap
import warnings
from collections.abc import Callable
from typing import TextIO

from trainfit.config import Config, ConfigError, check_writable, iter_fields, load_config, split_overrides
from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.parallel.layout import GlobalBatch, Layout


def _fields_help() -> str:
    lines = ["config fields (set in the TOML file, or as --section.field=value or --section.field value):"]
    section = None
    for name, field_name, default, doc in iter_fields():
        if name != section:
            section = name
            lines.append(f"\n  [{section}]")
        shown = "(from preset)" if default is None else repr(default)
        lines.append(f"  --{section}.{field_name}  default {shown}")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def _config_parser(sub: argparse._SubParsersAction, name: str, help_text: str, fields_help: str
                   ) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text, epilog=fields_help,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="TOML config (default: the built-in tiny run)")
    return parser


def cmd_estimate(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.estimate import as_json, estimate, with_traced_memory
    from trainfit.memory.report import check_figure_path, plot_breakdown, print_estimate
    from trainfit.plan.fixes import fewest_changes
    from trainfit.plan.space import with_global_batch

    cfg = load_config(args.config, overrides)
    if args.plot:
        check_figure_path("--plot", args.plot)
    est = estimate(cfg)
    for message in est.layout.ineffective_options():  # as `trainfit train` warns of them
        print(f"warning: {message}", file=sys.stderr)
    if args.traced:
        from trainfit.memory.traced import trace_step

        est = with_traced_memory(est, trace_step(cfg))
    # the fixes keep the global batch: when it is 0, the one this config's run derives (named in the output)
    fixable, batch = with_global_batch(cfg)
    fixes = [] if est.fits else fewest_changes(fixable)
    if args.json:
        out = as_json(est)
        if args.traced:
            out["timeline"] = [list(point) for point in est.memory.timeline]
        if not est.fits:
            out["fixes"] = [{"changes": list(f.changes), "memory_bytes": f.candidate.memory_bytes,
                             "tokens_per_second": f.candidate.tokens_per_second, "mfu": f.candidate.mfu}
                            for f in fixes]
            out["fixes_global_batch"] = batch.as_dict()
        print(json.dumps(out, indent=2))
    else:
        print_estimate(est, fixes=fixes, fixes_batch=None if est.fits else batch)
        if args.traced:
            print(f"traced in {est.memory.seconds:.1f} s ({est.memory.num_ops:,} operators, peak in "
                  f"{est.memory.peak_module!r}); estimating process peak RSS "
                  f"{est.memory.peak_rss_bytes / 2**30:.2f} GiB")
    if args.plot:
        path = plot_breakdown(est, args.plot)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.config import config_from_dict, read_raw, resolve_and_validate, write_atomic
    from trainfit.memory.report import check_figure_path, fmt_bytes
    from trainfit.plan.explain import plan_json, plan_table, plot_plan, search_summary, winner_toml
    from trainfit.plan.search import search
    from trainfit.plan.space import with_global_batch

    raw = read_raw(args.config, overrides)
    cfg = config_from_dict(raw)
    resolve_and_validate(cfg)
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
    fixed = frozenset(f"{section}.{name}" for section, values in raw.items() for name in values)
    # A plan keeps the global batch; when it is 0, the one `trainfit train` derives from the config as given
    # (search and compare_machines derive it the same way).
    _, batch = with_global_batch(cfg)
    if args.tokens is not None:
        return _plan_machines(args, cfg, fixed, batch)
    out = sys.stderr if args.json else sys.stdout
    _say_derived(batch, out)
    plan = search(cfg, fixed, top=args.top, precisions=precisions, exhaustive=bool(args.plot))
    if not plan.candidates and not plan.stats.groups:
        from trainfit.parallel.layout import build_layout

        build_layout(cfg)  # no layout was even valid: the config's own fields say why (a named error)
    if not plan.candidates:
        reasons = ", ".join(f"{n:,} {why}" for why, n in plan.stats.rejected.most_common(5))
        print(f"error: no layout of this model fits {cfg.hardware.num_gpus} x {cfg.hardware.gpu} with global batch "
              f"{batch.words()} ({reasons or 'no valid layout'}); add GPUs (hardware.num_gpus), a device with more "
              "memory (hardware.gpu), or unfix fields that you set", file=sys.stderr)
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
        console.print(plan_table(plan))
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
        Console().print(machines_table(options, args.tokens))
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
    from trainfit.memory.traced import trace_step

    checks = []
    for i, c in enumerate(candidates):
        print(f"tracing candidate {i + 1} of {len(candidates)} ...", file=sys.stderr)
        traced = with_traced_memory(estimate(c.cfg, c.layout), trace_step(c.cfg, c.layout))
        checks.append(traced.memory_bytes)
    return checks


def cmd_measure(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    from trainfit.estimate import as_json, estimate
    from trainfit.memory.compare import Comparison, comparison_table
    from trainfit.train.trainer import measure_step

    cfg = load_config(args.config, overrides)
    _check_steps(args.steps)
    measured = measure_step(cfg, steps=args.steps)
    est = estimate(cfg)
    if args.json:
        out = as_json(est)
        stage = {"stage": 0, **measured.breakdown.as_dict(), "device": measured.device, "rank": measured.rank}
        print(json.dumps({"model": out["model"], "per_rank": stage, "per_stage": [stage]}, indent=2))
    else:
        from rich.console import Console

        Console().print(comparison_table(Comparison({"measured": measured.breakdown}), "memory measured per rank"))
    return 0


def _check_steps(steps: int) -> None:
    if steps < 2:
        raise ConfigError(f"--steps {steps}: measure at least 2 steps (the first one warms up); try --steps 2")


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.profile:  # reads traces only: no torch
        return _report_profile(args, overrides)
    import json

    from rich.console import Console

    from trainfit.estimate import estimate
    from trainfit.memory.compare import Comparison, comparison_table, plot_comparison
    from trainfit.memory.report import check_figure_path
    from trainfit.memory.traced import trace_step
    from trainfit.train.trainer import measure_step

    cfg = load_config(args.config, overrides)
    _check_steps(args.steps)
    if args.plot:
        check_figure_path("--plot", args.plot)
    traced = trace_step(cfg)  # before measuring: tracing needs the process-group slot free
    measured = measure_step(cfg, steps=args.steps)
    cmp = Comparison({"analytic": estimate(cfg).worst, "traced": traced.worst, "measured": measured.breakdown},
                     {"traced": traced.timeline, "measured": measured.timeline})
    if args.json:
        print(json.dumps(cmp.as_dict(), indent=2))
    else:
        Console().print(comparison_table(cmp))
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

    from trainfit.memory.report import check_figure_path
    from trainfit.perf.trace import load_profiles
    from trainfit.perf.trace_report import operator_table, plot_timeline, time_table

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
        console.print(time_table(profiles))
        console.print(operator_table(profiles))
    missing = sorted(set(range(profiles[0].world_size)) - {p.rank for p in profiles})
    if missing:
        print(f"warning: no trace of rank(s) {', '.join(map(str, missing))} of {profiles[0].world_size}", file=out)
    if plot:
        print(f"wrote {plot_timeline(profiles, plot)}", file=out)
    else:
        print("no timeline picture: it needs matplotlib (pip install 'trainfit[plot]')", file=out)
    return 0


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.distributed import pick_device, run_layout
    from trainfit.train.preflight import preflight
    from trainfit.train.report import print_summary
    from trainfit.train.run_device import this_run_device
    from trainfit.train.trainer import Trainer, TrainingDiverged

    if args.profile is not None:  # every rank parses the same command line, so every rank profiles
        overrides = [*overrides, f"--logging.profile_steps={args.profile}"]
    cfg = load_config(args.config, overrides)
    layout = run_layout(cfg)
    device, _ = pick_device(cfg.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    # Estimated for the device this process got (a GPU left at hardware.gpu's default is matched to the catalog).
    here = dataclasses.replace(cfg, hardware=this_run_device(cfg.hardware, cfg.precision.mode, device).hardware)
    preflight(here, layout, device.type, force=args.force)  # folders, disk and memory, before any work
    predicted = {"analytic": _warn_if_it_will_not_fit(here, layout)}
    if cfg.logging.traced_estimate and cfg.logging.measure_memory and _is_rank_zero():  # vs the measured step
        predicted.update(_traced_estimate(here, layout))  # before the Trainer: tracing needs the free process group
    trainer = Trainer(cfg, layout)
    try:
        result = trainer.train()
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    print_summary(cfg, result, predicted=predicted)
    if result.stopped_by_signal:  # the shell's convention: 128 + the signal's number (130 Ctrl-C, 143 SIGTERM)
        return 128 + (signal.SIGINT if result.signal_name == "SIGINT" else signal.SIGTERM)
    return 0


def _is_rank_zero() -> bool:
    """Rank 0 of the launcher's world (or no launcher), known before any process group exists."""
    return os.environ.get("RANK", "0") == "0"


def _warn_if_it_will_not_fit(cfg: Config, layout: Layout) -> MemoryBreakdown:
    """The analytic estimate of rank 0 (the rank whose measured step the summary shows: pipeline
    rank 0's stages), before anything is allocated; a warning when the worst rank exceeds the device."""
    from trainfit.estimate import advice, estimate

    est = estimate(cfg, layout)
    if not est.fits and _is_rank_zero():
        need = est.total_bytes(est.worst) / 2**30
        print(f"warning: the estimate needs {need:.1f} GiB per GPU, more than the "
              f"{est.device_memory / 2**30:.1f} GiB of {cfg.hardware.gpu}:", file=sys.stderr)
        for line in advice(est):
            print(f"  - {line}", file=sys.stderr)
    return est.memory.per_stage[0]


def _traced_estimate(cfg: Config, layout: Layout) -> dict[str, MemoryBreakdown]:
    """{"traced": rank 0's traced estimate (pipeline rank 0's, as the analytic one)}, or {} with a
    warning when tracing fails (the run goes on)."""
    from trainfit.memory.traced import trace_step

    try:
        return {"traced": trace_step(cfg, layout).per_stage[0]}
    except Exception as err:  # a layout the tracer refuses must not stop the training run
        print(f"warning: no traced estimate ({type(err).__name__}: {err}); comparing the analytic one only",
              file=sys.stderr)
        return {}


def cmd_sample(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.sample import sample_from_checkpoint

    _reject_overrides(overrides)
    _check_sampling(args)
    text = sample_from_checkpoint(args.checkpoint, args.prompt, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    print(text)
    return 0


def _check_sampling(args: argparse.Namespace) -> None:
    """`trainfit sample`'s own options, before the checkpoint is loaded."""
    if args.prompt == "":
        raise ConfigError("--prompt '': give some text to continue (the default is a newline)")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy, 0.8 = default)")
    if args.top_k < 0:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 0 (0 keeps every token)")
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed {args.seed}: must be between 0 and 2**63 - 1")


def cmd_export(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.sample import export_to_hf

    _reject_overrides(overrides)
    out = export_to_hf(args.checkpoint, args.out, force=args.force)
    print(f"wrote {out}/model.safetensors and config.json (transformers: AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.data import prepare_data

    _reject_overrides(overrides)
    manifest = prepare_data(args.input, args.out, tokenizer=args.tokenizer,
                            bpe_vocab_size=args.bpe_vocab_size, val_fraction=args.val_fraction)
    counts = ", ".join(f"{k}: {v:,}" for k, v in manifest["num_tokens"].items())
    print(f"wrote {args.out} ({manifest['tokenizer']['name']}, vocab {manifest['vocab_size']:,}, "
          f"{manifest['dtype']}; tokens {counts})")
    return 0


def cmd_calibrate(args: argparse.Namespace, overrides: list[str]) -> int:
    import json

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trainfit.hardware_profile import write_profile
    from trainfit.perf.calibrate import calibrate, profile_tables, resolve_max_ranks

    _reject_overrides(overrides)
    check_writable("--out", args.out, replace=args.force)
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
            console.print(table)
    print(f"wrote {args.out}: use it as trainfit estimate --hardware.profile={args.out}",
          file=sys.stderr if args.json else sys.stdout)
    return 0


def _reject_overrides(overrides: list[str]) -> None:
    if overrides:
        raise ConfigError(f"unexpected arguments {overrides}: this command takes no config overrides")


COMMANDS: dict[str, Callable[[argparse.Namespace, list[str]], int]] = {
    "estimate": cmd_estimate,
    "plan": cmd_plan,
    "measure": cmd_measure,
    "report": cmd_report,
    "train": cmd_train,
    "sample": cmd_sample,
    "prepare-data": cmd_prepare_data,
    "export": cmd_export,
    "calibrate": cmd_calibrate,
}


INTRO = """\
trainfit: will this LLM training run fit, how fast will it go, and train it.

Predicts per-GPU memory (parameters, gradients, optimizer states, activations, peak), FLOPs, step
time and MFU for a model and a parallel layout; trains the same config for real (DDP, ZeRO-1/2/3,
HSDP, offload, bf16/fp16, activation checkpointing) and reports predicted against measured.

commands:
  estimate      predict memory and speed (no GPU needed, instant)
  plan          search every layout that fits a cluster, rank by predicted speed, write the fastest
  train         train a model (default: a tiny Llama on Shakespeare, on CPU, ~2 minutes)
  report        analytic and traced predictions against a measured step (--profile: a profiled run)
  measure       measure a real step's memory per component
  sample        generate text from a checkpoint
  export        write a checkpoint as Hugging Face safetensors
  prepare-data  tokenize text into training shards
  calibrate     measure this machine (matmuls, memory, collectives, optimizer) into a hardware profile

examples:
  trainfit estimate --model.preset=llama3-8b --hardware.gpu=H100-SXM-80GB --hardware.num_gpus=8
  trainfit plan --model.preset=llama3-70b --hardware.gpu=H100-SXM-80GB --hardware.num_gpus=64 \\
      --training.seq_len=8192 --training.global_batch_size=512 --out plan.toml
  trainfit train
  torchrun --nproc_per_node 2 -m trainfit train --parallel.zero_stage=3
  trainfit train --profile=4-5 && trainfit report --profile runs/default/profile
  trainfit calibrate --out cpu.toml && trainfit estimate --hardware.profile=cpu.toml

`trainfit COMMAND --help` lists a command's options and every config field with its default."""


def build_parser() -> argparse.ArgumentParser:
    about, rest = INTRO.split("\ncommands:")
    examples = "examples:" + rest.split("examples:")[1]
    parser = argparse.ArgumentParser(prog="trainfit", description=about, epilog=examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fields = _fields_help()  # the epilog of every command that reads a config
    estimate = _config_parser(sub, "estimate", "predict per-GPU memory, FLOPs, step time and MFU (no torch, instant)",
                              fields)
    estimate.add_argument("--json", action="store_true", help="print the estimate as one JSON object")
    estimate.add_argument("--plot", metavar="FILE.png", help="draw the memory breakdown as a stacked bar")
    estimate.add_argument("--traced", action="store_true",
                          help="run the real step on fake tensors and a fake process group (exact, slower)")
    plan = _config_parser(sub, "plan", "search the layouts that fit and rank them by predicted step time (no torch); "
                          "fields set in CONFIG or on the command line stay fixed, the others are searched", fields)
    plan.add_argument("--top", type=int, default=10, help="how many candidates to show (default 10)")
    plan.add_argument("--out", metavar="FILE.toml", help="write the fastest layout as a config trainfit train runs")
    plan.add_argument("--json", action="store_true", help="print the candidates and the search as one JSON object")
    plan.add_argument("--plot", metavar="FILE.png", help="draw tokens/s against memory for every candidate that fits "
                      "(searches exhaustively, without the bound)")
    plan.add_argument("--traced", type=int, default=0, metavar="K", help="re-check the first K candidates' memory "
                      "with the traced estimator (the real step on fake tensors: seconds to minutes each)")
    plan.add_argument("--tokens", type=float, metavar="N", help="compare machines instead: each device of "
                      "--gpu-options at 1, 2, 4 ... up to a node, then whole nodes doubling up to --max-gpus, its "
                      "fastest layout, the time to train N tokens and its cost")
    plan.add_argument("--gpu-options", metavar="DEVICES", help="with --tokens: devices to compare, comma-separated "
                      "(default: hardware.gpu)")
    plan.add_argument("--max-gpus", type=int, metavar="N", help="with --tokens: the most devices (default: "
                      "hardware.num_gpus)")
    plan.add_argument("--prices", metavar="PRICES", help="with --tokens: USD per GPU-hour, e.g. "
                      "H100-SXM-80GB=2.49,A100-SXM-80GB=1.60 (default: hardware.price_per_gpu_hour for hardware.gpu, "
                      "else trainfit.hardware's indicative prices)")
    plan.add_argument("--precisions", metavar="MODES", help="precision modes the plan may choose, comma-separated "
                      "(e.g. bf16-mixed,fp8-mixed; default: the config's, bf16-mixed on a GPU when unset)")
    measure = _config_parser(sub, "measure", "run real steps and measure memory at the allocator, per component",
                             fields)
    measure.add_argument("--json", action="store_true", help="print the estimate's schema (model, per_rank, per_stage)")
    measure.add_argument("--steps", type=int, default=2, help="steps to run; the last one is measured")
    report = _config_parser(sub, "report", "analytic and traced predictions against a measured step", fields)
    report.add_argument("--json", action="store_true")
    report.add_argument("--steps", type=int, default=2, help="steps to run; the last one is measured")
    report.add_argument("--plot", metavar="FILE.png", help="draw the step's memory timeline and the three breakdowns "
                        "(with --profile: the per-rank timeline, by default timeline.png beside the traces)")
    report.add_argument("--profile", metavar="TRACE",
                        help="summarise a `trainfit train --profile` run instead (its <logging.dir>/profile folder, "
                        "or one trace): per rank compute, communication, exposed communication, idle, top operators")
    train = _config_parser(sub, "train", "train a model from a config (default: tiny Llama on Shakespeare, CPU)",
                           fields)
    train.add_argument("--force", action="store_true",
                       help="start even when the memory estimate exceeds what this machine has")
    train.add_argument("--profile", metavar="STEPS",
                       help="torch.profiler trace of these steps on every rank: 3 or 3-5 (= --logging.profile_steps)")

    sample = sub.add_parser("sample", help="generate text from a trained checkpoint")
    sample.add_argument("--checkpoint", required=True, help="a checkpoint folder or a checkpoint.dir")
    sample.add_argument("--prompt", default="\n", help="text to continue")
    sample.add_argument("--max-new-tokens", type=int, default=200)
    sample.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    sample.add_argument("--top-k", type=int, default=50)
    sample.add_argument("--seed", type=int, default=0)

    export = sub.add_parser("export", help="write a checkpoint's weights as HF safetensors + config.json")
    export.add_argument("checkpoint", help="a checkpoint folder or a checkpoint.dir")
    export.add_argument("--out", required=True, help="output folder (new, or empty; --force replaces an export)")
    export.add_argument("--force", action="store_true", help="replace the files of an earlier export in --out")

    prep = sub.add_parser("prepare-data", help="tokenize text into memmap token shards with a manifest")
    prep.add_argument("input", help="a text file or a folder of .txt/.jsonl files ('' = packaged corpus)")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--tokenizer", default="bytes", help="bytes | a tokenizer.json path | train")
    prep.add_argument("--bpe-vocab-size", type=int, default=4096)
    prep.add_argument("--val-fraction", type=float, default=0.05)

    calib = sub.add_parser("calibrate", help="measure this machine into a hardware profile (TOML) for "
                           "--hardware.profile", description="measure matmul FLOP/s per dtype and shape, memory "
                           "bandwidth, collectives over gloo (nccl on GPUs) at 2..N ranks and the AdamW step, and "
                           "write them as a hardware profile that estimate and train read with "
                           "--hardware.profile=FILE (about a minute; --quick: seconds)")
    calib.add_argument("--out", default="hardware-profile.toml", metavar="FILE",
                       help="profile to write (default: %(default)s)")
    calib.add_argument("--force", action="store_true", help="replace an existing --out file")
    calib.add_argument("--quick", action="store_true", help="fewer, smaller samples: seconds, rougher figures")
    calib.add_argument("--max-ranks", type=int, metavar="N",
                       help="measure collectives at 2..N ranks (default: min(4, cores), at least 2; GPUs: min(4, "
                       "GPUs)); 1 skips them")
    calib.add_argument("--threads", type=int, metavar="N",
                       help="torch threads per process, as training would use (default: torch's here, which "
                       "follows OMP_NUM_THREADS; torchrun sets 1 per rank)")
    calib.add_argument("--json", action="store_true", help="print the profile as JSON instead of tables")
    return parser


def _format_warning(message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> str:
    """Warnings read like errors: one line, no source path."""
    return f"warning: {message}\n"


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _format_warning
    try:
        argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
        if not argv and not overrides:
            print(INTRO)
            return 0
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trainfit ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside training: checkpoints are written atomically
        print("interrupted: stopped at once; the last good checkpoint (if any) is intact", file=sys.stderr)
        return 128 + signal.SIGINT
