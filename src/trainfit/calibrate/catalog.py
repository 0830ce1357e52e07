"""A catalog GPU's published kernel figures as a hardware profile, in the TOML `trainfit calibrate`
writes: `trainfit calibrate --catalog GPU --out FILE`. Torch-free.

What a catalog GPU's estimate prices its kernels at (trainfit.perf.gpu_kernels: achievable matmul
rates less tile and wave quantization, attention kernels' published rates, memory bandwidth) is
written out at a grid of shapes, so that a user can read each figure beside its source, edit the
ones their machine differs in (a power cap, another attention kernel) and estimate with
--hardware.profile=FILE. The profile path prices a GEMM at its nearest written shape, so its
estimates follow the catalog's to within the grid's spacing; `trainfit calibrate` on the GPU
itself replaces every figure with a measured one.
"""

from __future__ import annotations

import datetime

from trainfit.config import ConfigError
from trainfit.hardware import COMM_EFFICIENCY, GPUS, LINKS
from trainfit.hardware_profile import (
    MATMUL_DTYPES,
    AttentionShape,
    HardwareProfile,
    LinkFit,
    Machine,
    MatmulBackward,
    MatmulShape,
    OptimizerFit,
)
from trainfit.perf import gpu_kernels as GK
from trainfit.perf.timing import ADAMW_BYTES_PER_PARAM, attention_kernel

SIZES = (1024, 2048, 4096, 8192, 16384)
"""m, k and n of the GEMMs written: every combination, per dtype."""
ATTENTION_HEADS, ATTENTION_HEAD_DIM = 16, 128
OPTIMIZER_PARAMS = (10**6, 10**8)
HOST_CORES = 64
"""machine.cores: a GPU's ranks share no cores, so as many as keep the time model from sharing them."""
BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}


def sources(gpu: str) -> str:
    """Where each figure of the profile comes from, as the file's header."""
    kernels = GK.kernels_of(gpu)
    return "\n".join([
        f"{gpu}: trainfit's catalog figures as a hardware profile (`trainfit calibrate --catalog {gpu}`), not",
        "a measurement; use it with --hardware.profile=FILE and edit what your machine differs in.",
        "matmul_shapes, matmul_backward, matmul_flops_per_s: the maximum achievable matmul rate",
        f"({kernels.source if kernels else 'no published measurement'}; others: datasheet peak x",
        f"{GK.MAMF_FRACTION_WITHOUT_MEASUREMENT}) less tile and wave quantization over "
        f"{kernels.sms if kernels else GK.DEFAULT_SMS} SMs (trainfit.perf.gpu_kernels).",
        "attention: FlashAttention-3's paper, Figs. 5-6 (H100 SXM5, head dim 128), the kernel torch picks on",
        "this device, scaled by its matmul rate over the H100's.",
        "memory_bytes_per_s: the datasheet's HBM bandwidth (trainfit.hardware); optimizer: AdamW's 28 bytes per",
        "parameter at it; link: the intra-node link's nominal bandwidth x the catalog's comm efficiency.",
    ])


def catalog_profile(gpu: str) -> HardwareProfile:
    """The profile of catalog GPU `gpu` (hardware.gpu's name); a ConfigError naming the choices otherwise."""
    if gpu not in GPUS:
        raise ConfigError(f"--catalog {gpu!r}: not a catalog GPU; choose one of {', '.join(GPUS)}")
    spec = GPUS[gpu]
    kernels = GK.kernels_of(gpu)
    sms = kernels.sms if kernels else GK.DEFAULT_SMS
    hbm = spec.hbm_bytes_per_s
    dtypes = [d for d in (*MATMUL_DTYPES, "fp8") if d in spec.peak_flops]
    shapes, backward, best = [], [], {}
    for dtype in dtypes:
        rate = GK.mamf(gpu, dtype, spec.peak_flops)
        for m in SIZES:
            for k in SIZES:
                for n in SIZES:
                    flops = 2 * m * k * n
                    args = (rate, sms, BYTES[dtype], hbm)
                    forward = flops / GK.gemm_seconds(m, k, n, *args)
                    shapes.append(MatmulShape(dtype, m, k, n, forward))
                    backward.append(MatmulBackward(dtype, m, k, n, flops / GK.gemm_seconds(m, n, k, *args),
                                                   flops / GK.gemm_seconds(k, m, n, *args)))
                    best[dtype] = max(best.get(dtype, 0.0), forward)
    kernel = attention_kernel("auto", gpu)
    attention = []
    for seq in GK.SEQ_LENS:
        fwd, bwd = GK.attention_rates(kernel, seq, GK.mamf(gpu, "bf16", spec.peak_flops))
        combined = (1 + 2.5) / (1 / fwd + 2.5 / bwd)  # forward FLOPs F and the fused backward's 2.5 F
        attention += [AttentionShape(dtype, 1, ATTENTION_HEADS, seq, ATTENTION_HEAD_DIM, combined)
                      for dtype in ("bf16", "fp16")]
    link = LINKS[spec.default_link]
    step_s = [p * ADAMW_BYTES_PER_PARAM / hbm for p in OPTIMIZER_PARAMS]
    return HardwareProfile(
        version=1,
        machine=Machine("cuda", gpu, HOST_CORES, 1, "", datetime.date.today().isoformat(), False, 0.0),
        matmul_flops_per_s=best, matmul_shapes=tuple(shapes), memory_bytes_per_s=hbm,
        optimizer=(OptimizerFit("adamw", "fused", "fp32", ADAMW_BYTES_PER_PARAM / hbm, 0.0, OPTIMIZER_PARAMS,
                                tuple(step_s)),),
        link=LinkFit(link.bytes_per_s * COMM_EFFICIENCY, link.latency_s), attention=tuple(attention),
        matmul_backward=tuple(backward))
