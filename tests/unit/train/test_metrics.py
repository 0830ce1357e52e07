"""metrics.jsonl holds plain JSON numbers and strings, whatever type the trainer hands over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from trainfit.train.metrics import METRICS_FILE, MetricsWriter, plain_value, read_metrics


@pytest.mark.parametrize(("value", "expected"), [
    (torch.tensor(3e-4), 3e-4),  # torchao's optimizers keep lr as a 0-d float32 tensor
    (torch.tensor([7]), 7),
    (np.float32(0.5), 0.5),
    (np.int64(12), 12),
    (np.bool_(True), True),
    (True, True),
    (3, 3),
    (1.5, 1.5),
    ("flash (CPU)", "flash (CPU)"),
    (None, None),
])
def test_plain_value_turns_scalars_into_python_numbers(value: object, expected: object) -> None:
    plain = plain_value("lr", value)
    assert type(plain) is type(expected)
    assert plain == pytest.approx(expected) if isinstance(expected, float) else plain == expected


@pytest.mark.parametrize("value", [torch.ones(2), np.zeros(3), [1.0], {"a": 1}])
def test_plain_value_refuses_what_is_no_single_number_naming_the_metric(value: object) -> None:
    with pytest.raises(TypeError, match="metric 'grad_norm'"):
        plain_value("grad_norm", value)


def test_writer_writes_tensor_and_numpy_values_as_numbers(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, resume_step=0, tensorboard=False)
    writer.write({"step": np.int64(1), "loss": torch.tensor(2.5), "lr": torch.tensor(1e-3), "mfu": np.float32(0.25)})
    writer.close()
    line = (tmp_path / METRICS_FILE).read_text()
    assert "tensor" not in line
    assert json.loads(line) == read_metrics(tmp_path)[0] == {"step": 1, "loss": 2.5, "lr": pytest.approx(1e-3),
                                                             "mfu": 0.25}
