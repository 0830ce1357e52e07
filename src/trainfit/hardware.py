"""Device catalog: memory, dense peak FLOP/s per dtype, HBM bandwidth. Torch-free.

Figures are the vendors' dense (no sparsity) tensor-core peaks from their datasheets:
NVIDIA H100 datasheet (SXM5 / PCIe), H200 product brief, A100 datasheet, L40S datasheet,
Ada (RTX 4090) whitepaper appendix, AMD Instinct MI300X datasheet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainfit.config import ConfigError, HardwareConfig

TERA = 1e12
GIB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    """Device memory as the vendor states it (GB = 1e9 bytes)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by compute dtype: fp32 (non-tensor), tf32, bf16, fp16, fp8."""
    hbm_bytes_per_s: float


def _gpu(name: str, mem_gb: float, fp32: float, tf32: float, bf16: float, fp8: float | None,
         hbm_tb_s: float) -> DeviceSpec:
    flops = {"fp32": fp32 * TERA, "tf32": tf32 * TERA, "bf16": bf16 * TERA, "fp16": bf16 * TERA}
    if fp8 is not None:
        flops["fp8"] = fp8 * TERA
    return DeviceSpec(name, int(mem_gb * GB), flops, hbm_tb_s * 1e12)


GPUS: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _gpu("H100-SXM-80GB", 80, 67.0, 494.7, 989.4, 1978.9, 3.35),
        _gpu("H100-PCIe-80GB", 80, 51.2, 378.0, 756.0, 1513.0, 2.0),
        _gpu("H200-141GB", 141, 67.0, 494.7, 989.4, 1978.9, 4.8),
        _gpu("A100-SXM-80GB", 80, 19.5, 156.0, 312.0, None, 2.039),
        _gpu("A100-40GB", 40, 19.5, 156.0, 312.0, None, 1.555),
        _gpu("L40S", 48, 91.6, 183.0, 362.05, 733.0, 0.864),
        _gpu("RTX-4090", 24, 82.6, 82.6, 165.2, 330.3, 1.008),
        _gpu("MI300X", 192, 163.4, 653.7, 1307.4, 2614.9, 5.3),
    )
}

# Nominal CPU peak per core: AVX2, 2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz = 96 GFLOP/s.
# A nominal figure for MFU on laptops and CI; override it with hardware.peak_tflops.
CPU_FLOPS_PER_CORE = 96e9


def cpu_spec() -> DeviceSpec:
    cores = os.cpu_count() or 1
    peak = cores * CPU_FLOPS_PER_CORE
    return DeviceSpec("cpu", 0, {k: peak for k in ("fp32", "tf32", "bf16", "fp16")}, 20e9)


def device_spec(hw: HardwareConfig) -> DeviceSpec:
    """The catalog entry named by hardware.gpu, with hardware.* overrides applied."""
    if hw.gpu == "cpu":
        spec = cpu_spec()
    elif hw.gpu in GPUS:
        spec = GPUS[hw.gpu]
    else:
        raise ConfigError(
            f"hardware.gpu={hw.gpu!r}: unknown device; choose one of cpu, {', '.join(GPUS)} "
            "(or pick the closest and set hardware.peak_tflops / hardware.memory_gib)"
        )
    flops = dict(spec.peak_flops)
    if hw.peak_tflops:
        flops = {k: hw.peak_tflops * TERA for k in flops}
    memory = int(hw.memory_gib * GIB) if hw.memory_gib else spec.memory_bytes
    return DeviceSpec(spec.name, memory, flops, spec.hbm_bytes_per_s)


def compute_dtype_of(precision_mode: str) -> str:
    """The dtype whose peak bounds the matmuls of a precision mode."""
    return {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-pure": "bf16", "fp16-mixed": "fp16",
            "fp8-mixed": "fp8"}[precision_mode]


def peak_flops(hw: HardwareConfig, precision_mode: str) -> float:
    spec = device_spec(hw)
    dtype = compute_dtype_of(precision_mode)
    if dtype not in spec.peak_flops:
        raise ConfigError(f"precision.mode={precision_mode!r}: {spec.name} has no {dtype} tensor cores; "
                          "use bf16-mixed")
    return spec.peak_flops[dtype]
