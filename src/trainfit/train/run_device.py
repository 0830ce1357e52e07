"""The device this process trains on, matched to the hardware catalog: what MFU and the pre-flight
estimate must be computed for.

hardware.gpu describes the device of an estimate; a run trains on whatever device it got. Left at
its default (cpu) on a GPU, MFU would be measured against a CPU's peak (and read above 100%) and
pre-flight would leave out the CUDA context. So on CUDA the device's name is matched to the catalog
(trainfit.hardware.catalog_gpu_of); a catalog device that contradicts the one found is an error; a
GPU the catalog does not hold gets no MFU unless hardware.peak_tflops gives its peak. Training on
the CPU, MFU is the CPU's, whatever GPU the config describes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainfit.config import ConfigError
from trainfit.config.schema import HardwareConfig
from trainfit.hardware import canonical_gpu, catalog_gpu_of, peak_flops


@dataclass(frozen=True)
class RunDevice:
    """The hardware a run is measured against."""

    hardware: HardwareConfig
    """hardware.* as this process's device makes it (gpu matched to the device found)."""
    peak_flops: float | None
    """One device's dense peak for the run's precision; None: unknown (no MFU)."""
    note: str | None = None
    """What was derived or cannot be computed, for the training log."""


def run_device(hw: HardwareConfig, precision_mode: str, device_type: str, device_name: str = "") -> RunDevice:
    """hardware.* for a run on `device_type` (torch.device.type) named `device_name` (CUDA's
    get_device_name; "" elsewhere). Another device type (meta: the traced estimator's step) keeps
    hardware.* as written."""
    if device_type not in ("cpu", "cuda"):
        return RunDevice(hw, peak_flops(hw, precision_mode))
    if device_type == "cpu":
        if hw.gpu == "cpu":
            return RunDevice(hw, peak_flops(hw, precision_mode))
        cpu = replace(hw, gpu="cpu", peak_tflops=0.0, memory_gib=0.0, hbm_tbps=0.0, profile="")
        return RunDevice(cpu, peak_flops(cpu, precision_mode),
                         f"hardware.gpu={hw.gpu!r} describes another device: this run trains on the CPU, and its MFU "
                         "and pre-flight estimate are the CPU's")
    found = catalog_gpu_of(device_name)
    if hw.gpu == "cpu":
        if found is not None:
            matched = replace(hw, gpu=found)
            return RunDevice(matched, peak_flops(matched, precision_mode),
                             f"hardware.gpu derived: {found} (this process's device: {device_name})")
        if hw.peak_tflops:
            return RunDevice(hw, hw.peak_tflops * 1e12, f"{device_name} is not in the catalog: MFU against "
                                                        f"hardware.peak_tflops={hw.peak_tflops:g}")
        return RunDevice(hw, None, f"MFU not computed: {device_name} is not in the catalog; set hardware.gpu to the "
                                   "closest catalog device and hardware.peak_tflops to this one's dense peak")
    named = canonical_gpu(hw.gpu)
    if found is not None and found != named:
        raise ConfigError(f"hardware.gpu={hw.gpu!r}: this process trains on {device_name} ({found}); set "
                          f"--hardware.gpu={found}, or leave hardware.gpu at its default to take the device found")
    note = None if found else (f"{device_name} is not in the catalog: MFU and pre-flight use hardware.gpu={hw.gpu!r}"
                               + (" with hardware.peak_tflops" if hw.peak_tflops else ""))
    return RunDevice(hw, peak_flops(hw, precision_mode), note)


def this_run_device(hw: HardwareConfig, precision_mode: str, device: torch.device) -> RunDevice:
    """run_device for `device`, reading its name on CUDA."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return run_device(hw, precision_mode, device.type, name)
