"""Defaults that follow the model and the device the user chose.

The schema's training defaults (16 sequences of 128 tokens per rank, fp32) are the tiny default
model's on a CPU. For a model of a billion parameters or more, a field the user left takes what such
a run uses: one sequence per rank (the planner searches larger ones), under pipeline parallelism as
many of them per step as the schedule needs micro-batches, sequences of the model's context up to
LONG_SEQUENCE tokens, and on a GPU bf16 autocast. Each is said where the run is
described (`trainfit estimate`), and set explicitly it is never changed."""

from __future__ import annotations

from typing import Any

from trainfit.config import Config
from trainfit.parallel.schedules import SCHEDULES

LARGE_MODEL_PARAMS = 10**9
"""From here on a model is not trained like the tiny default: its defaults follow it."""
LONG_SEQUENCE = 8192
"""The longest default sequence: the model's context, at most this (Llama 3's pre-training length)."""


def follow_model(raw: dict[str, dict[str, Any]], cfg: Config) -> list[str]:
    """Set, in cfg (validated, its model filled), the fields the user did not write (absent from
    `raw`) whose schema default suits only the tiny model; each as `section.field=value (why)`."""
    from trainfit.models.params import param_counts

    if param_counts(cfg.model).total < LARGE_MODEL_PARAMS:
        return []
    written = {f"{section}.{name}" for section, values in raw.items() for name in values}
    notes = []

    def derive(key: str, value: Any, why: str) -> None:
        section, name = key.split(".")
        if key in written or getattr(getattr(cfg, section), name) == value:
            return
        setattr(getattr(cfg, section), name, value)
        notes.append(f"{key}={str(value).lower() if isinstance(value, bool) else value} ({why})")

    derive("training.micro_batch_size", 1, "one sequence per rank; trainfit plan searches larger ones")
    p, t = cfg.parallel, cfg.training
    model_parallel = p.tp * p.pp * p.cp
    if p.pp > 1 and not t.global_batch_size and cfg.hardware.num_gpus % model_parallel == 0:
        # a pipeline needs a micro-batch per stage at least: micro_batch_size x dp alone would leave it idle
        least = SCHEDULES[p.pp_schedule].least_microbatches(p.pp, 2)
        derive("training.global_batch_size", t.micro_batch_size * least * (cfg.hardware.num_gpus // model_parallel),
               f"{least} micro-batches of {t.micro_batch_size} per data-parallel rank, the fewest the "
               f"{p.pp} pipeline stages take")
    derive("training.seq_len", min(cfg.model.max_seq_len, LONG_SEQUENCE),
           f"the model's context, at most {LONG_SEQUENCE:,}")
    if cfg.hardware.gpu != "cpu":
        derive("precision.mode", "bf16-mixed", "bf16 autocast, as GPU training runs")
    return notes
