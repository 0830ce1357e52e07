"""Per-step metrics: one JSON line per logged step in `<logging.dir>/metrics.jsonl`, optionally
mirrored to TensorBoard. A resumed run first drops the lines written after its checkpoint, so
the file always tells one consistent history."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError

METRICS_FILE = "metrics.jsonl"


def read_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(log_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
