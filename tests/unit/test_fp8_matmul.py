"""The fp8 matmul probe (trainfit/fp8_matmul.py): it calls torch._scaled_mm as torchao's float8 linear
does, finds a reference kernel (injected here: a torch._scaled_mm that sleeps) within its deadline,
warns an fp8-mixed run about it once before step 1, names the fix, records both rates in
metrics.jsonl, and stays out of every other precision's run. Nothing here times anything: the
deadline is checked by counting the slow kernel's calls."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

from _runs import run_config
from trainfit.config import ConfigError
from trainfit.fp8_matmul import (
    DEADLINE_S,
    PROBE_SHAPE,
    ROUNDS,
    SLOW_FACTOR,
    fp8_is_slow,
    fp8_matmul,
    gflops,
    probe_fp8_matmul,
)
from trainfit.train.distributed import World
from trainfit.train.trainer import Trainer

REAL_SCALED_MM = torch._scaled_mm
ONE_STEP = ("--training.steps=1", "--training.warmup_steps=0", "--model.num_layers=1")


class Recorded:
    """torch._scaled_mm, recording the form of each call (and sleeping `sleep_s` first: a slow kernel)."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s
        self.calls: list[dict[str, Any]] = []

    def __call__(self, a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        m, n = a.shape[0], b.shape[1]
        scales = tuple(tuple(kwargs[s].shape) for s in ("scale_a", "scale_b"))
        self.calls.append({"dtypes": (a.dtype, b.dtype), "a row-major": a.stride() == (a.shape[1], 1),
                           "b column-major": b.stride() == (1, b.shape[0]),
                           "scales": "tensorwise" if scales == ((), ()) else
                           "rowwise" if scales == ((m, 1), (1, n)) else scales,
                           **{k: v for k, v in kwargs.items() if k not in ("scale_a", "scale_b") and v is not None}})
        time.sleep(self.sleep_s)
        return REAL_SCALED_MM(a, b, **kwargs)


def _installed(monkeypatch: pytest.MonkeyPatch, kernel: Callable[..., torch.Tensor]) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", kernel)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_probe_calls_scaled_mm_as_torchao_float8_linear_forward_does(scaling: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = Recorded()
    _installed(monkeypatch, recorded)
    linear = Float8Linear.from_float(nn.Linear(64, 32, bias=False), config=Float8LinearConfig.from_recipe_name(scaling))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear(torch.randn(48, 64))
    (torchao_forward,) = recorded.calls
    fp8_matmul(48, 64, 32, "cpu", scaling)()
    assert recorded.calls[1] == torchao_forward
    assert torchao_forward["scales"] == scaling and torchao_forward["out_dtype"] == torch.bfloat16


def test_the_probe_measures_both_kernels_at_its_shape() -> None:
    rates = probe_fp8_matmul("cpu", "rowwise")
    assert (rates.device, rates.scaling, rates.shape) == ("cpu", "rowwise", PROBE_SHAPE)
    assert rates.fp8_flops_per_s > 0 and rates.bf16_flops_per_s > 0
    assert rates.note() == (f"fp8 matmul probe (cpu, 128 x 128 x 128, rowwise scales): fp8 "
                            f"{gflops(rates.fp8_flops_per_s)} GFLOP/s, bf16 {gflops(rates.bf16_flops_per_s)} GFLOP/s")
    assert rates.record() == {"fp8_matmul_flops_per_s": rates.fp8_flops_per_s,
                              "bf16_matmul_flops_per_s": rates.bf16_flops_per_s, "fp8_probe_shape": "128x128x128",
                              "fp8_probe_scaling": "rowwise"}


def test_a_reference_kernel_is_found_and_called_once_past_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = Recorded(sleep_s=2 * DEADLINE_S)  # one call longer than the deadline: that call is the answer
    _installed(monkeypatch, slow)
    rates = probe_fp8_matmul("cpu")
    assert len(slow.calls) == 1
    m, k, n = PROBE_SHAPE
    assert rates.fp8_flops_per_s < 2 * m * k * n / (2 * DEADLINE_S)
    assert rates.slow
    warning = rates.warning()
    assert warning.startswith(f"precision.mode='fp8-mixed': fp8 matmuls run at {gflops(rates.fp8_flops_per_s)} "
                              f"GFLOP/s on this cpu against bf16's {gflops(rates.bf16_flops_per_s)} GFLOP/s")
    assert "it has no fp8 hardware" in warning
    assert warning.endswith("use precision.mode=bf16-mixed on this machine; fp8 is for GPUs with fp8 tensor cores "
                            "(H100, H200, MI300X ...)")


def test_a_kernel_under_the_deadline_is_called_until_its_calls_pass_it(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = Recorded(sleep_s=DEADLINE_S / 2.5)
    _installed(monkeypatch, slow)
    probe_fp8_matmul("cpu")
    assert 1 <= len(slow.calls) <= 3 < ROUNDS  # 0.4, 0.8, 1.2 deadlines: no call after the third


def test_slow_means_below_a_tenth_of_bf16s_rate() -> None:
    assert SLOW_FACTOR == 10
    assert fp8_is_slow(0.04e9, 100e9)  # a reference kernel
    assert not fp8_is_slow(15e9, 6e9)  # fp8 faster than bf16 (this CPU's kernels, or fp8 hardware)
    assert not fp8_is_slow(0.5e9, 1e9)  # about equal, or a disturbed timing: one kernel launch on a GPU
    assert not fp8_is_slow(0.11e9, 1e9) and fp8_is_slow(0.09e9, 1e9)


def test_rates_read_well_at_every_scale() -> None:
    assert [gflops(r) for r in (0.0451e9, 0.5e9, 7.25e9, 1234.5e9)] == ["0.045", "0.5", "7.2", "1,234.5"]


def test_a_device_where_scaled_mm_cannot_run_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")

    _installed(monkeypatch, unsupported)
    with pytest.raises(ConfigError, match=r"precision.mode='fp8-mixed': torch._scaled_mm cannot run on this cpu "
                                          r"\(torch._scaled_mm is only supported .*\); use precision.mode=bf16-mixed"):
        probe_fp8_matmul("cpu")


# ---------------------------------------------------------------- in a run


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_an_fp8_run_on_a_reference_kernel_warns_before_step_1_and_records_both_rates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_config(tmp_path, "--precision.mode=fp8-mixed", *ONE_STEP)
    with monkeypatch.context() as patch:  # the slow kernel for the probe only: the step runs the real one
        slow = Recorded(sleep_s=2 * DEADLINE_S)
        _installed(patch, slow)
        with pytest.warns(UserWarning, match=r"precision.mode='fp8-mixed': fp8 matmuls run at .* on this cpu .*"
                                             r"use precision.mode=bf16-mixed on this machine") as caught:
            trainer = Trainer(cfg, world=World())
    assert len(slow.calls) == 1 and len([w for w in caught if "fp8 matmuls" in str(w.message)]) == 1
    rates = trainer.fp8_matmul
    assert rates is not None and rates.slow and rates.note() in trainer.notes
    trainer.train()
    (record,) = [r for r in _records(tmp_path) if "fp8_matmul_flops_per_s" in r]
    assert record == {"step": 0, **rates.record()}
    assert {"step": 0, "note": rates.note()} in _records(tmp_path)


def test_other_precisions_run_no_fp8_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("torch._scaled_mm ran outside fp8-mixed")

    _installed(monkeypatch, forbidden)
    cfg = run_config(tmp_path, "--precision.mode=bf16-mixed", *ONE_STEP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(cfg, world=World())
        trainer.train()
    assert trainer.fp8_matmul is None
    assert not [w for w in caught if "fp8" in str(w.message)]
    assert not [r for r in _records(tmp_path) if "fp8_matmul_flops_per_s" in r or "fp8" in r.get("note", "")]
