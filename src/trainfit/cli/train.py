"""`trainfit train`: pre-flight, the predictions to compare against, the training run and its summary."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from trainfit.config import Config
from trainfit.configure import read_config
from trainfit.memory import MemoryBreakdown
from trainfit.parallel.layout import Layout


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.train.distributed import pick_device, run_layout
    from trainfit.train.preflight import preflight
    from trainfit.train.report import print_summary
    from trainfit.train.run_device import this_run_device
    from trainfit.train.trainer import Trainer, TrainingDiverged

    if args.profile is not None:  # every rank parses the same command line, so every rank profiles
        overrides = [*overrides, f"--logging.profile_steps={args.profile}"]
    _, cfg, derived = read_config(args.config, overrides)
    if derived:
        from trainfit.tables import say_derived

        say_derived(derived, stderr=True)
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
    from trainfit.traced import trace_step

    try:
        return {"traced": trace_step(cfg, layout).per_stage[0]}
    except Exception as err:  # a layout the tracer refuses must not stop the training run
        print(f"warning: no traced estimate ({type(err).__name__}: {err}); comparing the analytic one only",
              file=sys.stderr)
        return {}
