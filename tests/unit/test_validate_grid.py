"""`trainfit validate`'s grid, built torch-free from a description of the device: on a GPU every
technique the issue names, both models sized from the analytic estimate to fill 20-60% of the
device; what the device cannot run skipped with its reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.validate.grid import FILL, POINT_NAMES, DeviceInfo, build_grid, select

MIB = 1024**2
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 81559 * MIB, "H100-SXM-80GB")
"""A fake 80 GB device with fp8 and compile."""


def test_an_80gb_fp8_gpu_gets_every_technique_on_a_dense_and_an_moe_model() -> None:
    grid = build_grid(H100)
    assert len(grid.points) >= 12
    assert all(p.skip is None for p in grid.points)
    configs = [load_config(None, list(p.overrides)) for p in grid.points]
    assert {c.precision.mode for c in configs} >= {"fp32", "bf16-mixed", "fp8-mixed"}
    assert {c.memory.activation_checkpointing for c in configs} == {"none", "selective", "selective-alternate", "full"}
    assert any(c.memory.chunked_loss for c in configs)
    assert any(c.training.compile for c in configs)
    assert any(c.memory.offload == "optimizer" for c in configs)
    assert {c.model.num_experts > 0 for c in configs} == {True, False}  # dense and MoE
    assert {c.training.device for c in configs} == {"cuda"}
    assert {c.hardware.gpu for c in configs} == {"H100-SXM-80GB"}


@pytest.mark.parametrize("device", [H100, DeviceInfo("cuda", "NVIDIA L4", 23034 * MIB, "L4"),
                                    DeviceInfo("cuda", "NVIDIA H200", 143771 * MIB, "H200-141GB")],
                         ids=["H100", "L4", "H200"])
def test_every_gpu_point_fills_20_to_60_percent_of_the_device(device: DeviceInfo) -> None:
    grid = build_grid(device)
    for point in grid.points:
        fraction = point.analytic_peak / device.memory_bytes
        assert FILL[0] <= fraction <= FILL[1], (point.name, fraction)
    layers = {name: load_config(None, list(models)).model.num_layers for name, models in grid.models.items()}
    assert layers["dense"] > 2 and layers["moe"] > 2


def test_the_models_are_sized_from_the_device_memory_not_fixed() -> None:
    small = build_grid(DeviceInfo("cuda", "NVIDIA L4", 23034 * MIB, "L4"))
    large = build_grid(H100)
    for model in ("dense", "moe"):
        assert (load_config(None, list(small.models[model])).model.num_layers
                < load_config(None, list(large.models[model])).model.num_layers)


def test_what_the_device_cannot_run_is_skipped_with_its_reason() -> None:
    a100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 81920 * MIB, "A100-SXM-80GB",
                      fp8_reason="no fp8 hardware: compute capability 8.0", compile_reason="no triton")
    grid = build_grid(a100)
    skipped = {p.name: p.skip for p in grid.points if p.skip}
    assert skipped == {"dense-fp8": "no fp8 hardware: compute capability 8.0", "dense-bf16-compile": "no triton"}
    assert [p.name for p in grid.points] == POINT_NAMES  # skipped, never dropped


def test_a_gpu_outside_the_catalog_is_estimated_with_its_own_memory() -> None:
    grid = build_grid(DeviceInfo("cuda", "NVIDIA H100 NVL", 95830 * MIB, None))
    assert grid.notes and "not in the catalog" in grid.notes[0]
    cfg = load_config(None, list(grid.points[0].overrides))
    assert cfg.hardware.memory_gib == pytest.approx(95830 / 1024, abs=1e-3)


def test_the_cpu_grid_is_the_debug_models_with_the_same_points() -> None:
    grid = build_grid(DeviceInfo("cpu", "x86_64", fp8_reason="no fp8 hardware"))
    assert [p.name for p in grid.points] == POINT_NAMES
    presets = {load_config(None, list(p.overrides)).model.preset for p in grid.points}
    assert presets == {"debug", "debug-moe"}
    assert {p.name for p in grid.points if p.skip} == {"dense-fp8", "dense-bf16-compile"}


def test_a_bad_only_name_is_a_named_error() -> None:
    with pytest.raises(ConfigError, match=r"--only dense-bf17: no such step or grid point; choose from calibrate"):
        select(None, ["dense-bf16", "dense-bf17"], ["calibrate", "train"])
    assert select(None, ["moe-bf16", "train"], ["calibrate", "train"]) == ["train", "moe-bf16"]


def test_building_the_grid_imports_no_torch() -> None:
    code = ("import sys; from trainfit.validate.grid import build_grid, DeviceInfo; "
            "build_grid(DeviceInfo('cuda', 'x', 80 * 1024**3, 'H100-SXM-80GB')); assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
