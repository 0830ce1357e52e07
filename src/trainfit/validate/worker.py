"""One grid point of `trainfit validate`, in a process of its own (the caching allocator's statistics
start fresh, and an out-of-memory error or a CUDA fault ends this point only):

    python -m trainfit.validate.worker RESULT.json --timed-steps N -- --section.field=value ...

The analytic estimate and the traced one first, then a Trainer's steps: one watched (warm-up, and
the compile under training.compile), one measured per component at the allocator (the tensors' peak
the estimators model), then N plain steps, each synchronized and timed, on CUDA with the allocator's
peak statistics reset before it: max_memory_allocated and max_memory_reserved are that step's. RESULT
is rewritten after each stage, so a point that dies leaves what it had.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trainfit.config import write_atomic


class Result:
    """The point's figures, written whole to `path` at every put()."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures: dict[str, Any] = {"predicted": {}, "measured": {}}

    def put(self, section: str, **figures: Any) -> None:
        self.figures[section].update(figures)
        write_atomic(self.path, json.dumps(self.figures, indent=1))


def run_point(overrides: list[str], *, timed_steps: int, result: Result) -> None:
    """Predict, then measure, the step of `overrides` on this process's device (see the module docstring)."""
    from trainfit.configure import load_config
    from trainfit.estimate import estimate
    from trainfit.models.params import param_counts

    cfg = load_config(None, overrides)
    est = estimate(cfg)
    fragmentation = est.worst.margin_terms.get("allocator_fragmentation")
    result.put("predicted", analytic_peak_bytes=est.worst.peak, analytic_margin_bytes=est.worst.reserved_margin,
               analytic_reserved_bytes=None if fragmentation is None else est.worst.peak + fragmentation,
               step_time_s=est.perf.time["step_time_s"], num_params=param_counts(cfg.model).total)

    import torch

    from trainfit.traced import trace_step
    from trainfit.train.trainer import Trainer

    start = time.perf_counter()
    traced = trace_step(cfg)  # before the Trainer: tracing needs the process-group slot free
    result.put("predicted", traced_peak_bytes=traced.worst.peak, traced_seconds=time.perf_counter() - start,
               traced_reserved_bytes=traced.worst.reserved_peak)  # the allocator's rules replayed (GPU only)
    trainer = Trainer(cfg)
    try:
        cuda = trainer.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        start = time.perf_counter()
        trainer.watched_step()
        result.put("measured", first_step_s=time.perf_counter() - start)
        stats = trainer.measured_step()
        memory = stats.memory
        assert memory is not None
        result.put("measured", tensor_peak_bytes=memory.peak, non_tensor_bytes=memory.non_tensor,
                   peak_phase=memory.peak_phase)
        times, allocated, reserved, losses = [], [], [], [stats.loss]
        for _ in range(timed_steps):
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            losses.append(trainer.train_step().loss)
            sync()
            times.append(time.perf_counter() - start)
            if cuda:
                allocated.append(torch.cuda.max_memory_allocated())
                reserved.append(torch.cuda.max_memory_reserved())
        result.put("measured", step_time_s=statistics.median(times), step_times_s=times,
                   allocated_peak_bytes=max(allocated) if cuda else memory.peak,
                   allocated_source="torch.cuda.max_memory_allocated" if cuda else "the memory meter's tensor peak",
                   reserved_peak_bytes=max(reserved) if cuda else None, losses=losses,
                   losses_finite=all(math.isfinite(v) for v in losses))
    finally:
        trainer.close()
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"a loss is not finite: {losses}")


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path)
    parser.add_argument("--timed-steps", type=int, default=3)
    args = parser.parse_args(argv[:split])
    run_point(argv[split + 1:], timed_steps=args.timed_steps, result=Result(args.result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
