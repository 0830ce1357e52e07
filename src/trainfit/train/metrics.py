"""Per-step metrics: one JSON line per logged step in `<logging.dir>/metrics.jsonl`, optionally
mirrored to TensorBoard. A resumed run first drops the lines written after its checkpoint, so
the file always tells one consistent history. Every value is written as a plain number, string,
bool or null (`plain_value`): optimizers and meters may hand over one-element tensors (torchao's
optimizers keep the learning rate as one) or numpy scalars."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainfit.config import ConfigError

METRICS_FILE = "metrics.jsonl"


def read_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(log_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plain_value(key: str, value: Any) -> bool | int | float | str | None:
    """`value` as the JSON scalar it stands for: a one-element tensor or a numpy scalar becomes its
    Python number (`.item()`), a subclass of bool, int or float that type itself."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and math.prod(value.shape) == 1:
        return value.item()
    for kind in (bool, int, float):  # bool first: it is an int
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"metric {key!r}: {type(value).__name__} {value!r} is not a number or a string; "
                    "log a one-element tensor or a plain value")


def plain_record(record: dict[str, Any]) -> dict[str, bool | int | float | str | None]:
    """`record` with every value a plain JSON scalar (plain_value)."""
    return {key: plain_value(key, value) for key, value in record.items()}


class MetricsWriter:
    def __init__(self, log_dir: str | Path, *, resume_step: int, tensorboard: bool) -> None:
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        self._truncate_after(resume_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the whole run
        self._tb = _tensorboard_writer(self.dir) if tensorboard else None

    def _truncate_after(self, step: int) -> None:
        """Keep only records up to `step` (all of them are dropped for a fresh run, step 0)."""
        kept = [r for r in read_metrics(self.dir) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        record = plain_record(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ConfigError("logging.tensorboard=true: the tensorboard package is not installed; "
                          "pip install 'trainfit[tensorboard]' or set logging.tensorboard=false") from err
    return SummaryWriter(log_dir=str(log_dir / "tensorboard"))


class ThroughputWindow:
    """Tokens/s over the steps since the last logged record, counting only steps timed as training
    runs: a step that warms up (this process's first: cuBLAS handles, NCCL communicators, the
    allocator's first blocks) or is instrumented (memory-measured: a probe after every operator;
    profiled) is not training throughput, and in a short run it would dominate the mean."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.steps, self.seconds, self.trained = 0, 0.0, 0

    def add(self, seconds: float, *, timed: bool, trained_tokens: int | None = None) -> None:
        if timed:
            self.steps += 1
            self.seconds += seconds
            self.trained += trained_tokens or 0

    def tokens_per_s(self) -> float | None:
        """None when no timed step ran since the last reset."""
        return self.steps * self.tokens_per_step / self.seconds if self.seconds > 0 else None

    def trained_tokens_per_s(self) -> float | None:
        """Fine-tuning samples: the trained targets' rate (tokens_per_s counts the prompts and the padding)."""
        return self.trained / self.seconds if self.seconds > 0 and self.trained else None

    def reset(self) -> None:
        self.steps, self.seconds, self.trained = 0, 0.0, 0
