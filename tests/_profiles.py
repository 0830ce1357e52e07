"""A hand-made hardware profile for the tests of calibration and of what a profile prices."""

from __future__ import annotations

import dataclasses

from trainfit.hardware_profile import CollectiveFit, HardwareProfile, LinkFit, Machine, MatmulShape, OptimizerFit


def profile(**changes: object) -> HardwareProfile:
    """A hand-made CPU profile (numbers of at most 6 significant digits: the TOML keeps them exactly)."""
    base = HardwareProfile(
        version=1,
        machine=Machine(device="cpu", name="Test CPU \"x\"", cores=2, threads=1, torch="2.13.0", date="2025-01-01",
                        quick=True, seconds=9.5),
        matmul_flops_per_s={"fp32": 5e10, "bf16": 2e9, "fp16": 1.5e9},
        matmul_shapes=(MatmulShape("fp32", 512, 128, 128, 4e10), MatmulShape("fp32", 512, 128, 512, 5e10),
                       MatmulShape("bf16", 512, 128, 128, 2e9), MatmulShape("fp16", 512, 128, 128, 1.5e9)),
        memory_bytes_per_s=1.5e10,
        optimizer=(OptimizerFit("adamw", "fused", "fp32", 1.25e-9, 2e-5, (262144, 1048576), (3.5e-4, 1.33e-3)),),
        link=LinkFit(bytes_per_s=1e9, latency_s=1e-4),
        collectives=(CollectiveFit("all_reduce", 2, 1e9, 1e-4, (4096, 1048576), (2.2e-4, 1.2e-3)),),
    )
    return dataclasses.replace(base, **changes)
