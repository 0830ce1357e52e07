"""What each kernel of a step achieves on a catalog GPU, from published measurements. Torch-free.

The catalog once priced a GPU's whole step at its datasheet peak times one efficiency. A GPU's
kernels reach different fractions of that peak, and the mix differs between a 1B model at 4K
tokens and a 405B model at 128K, so each kind of work is priced on its own:

- GEMMs: the maximum achievable matmul rate (MAMF: the best sustained rate over a search of large
  shapes, stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
  comparison table", bf16 and fp8 rows), lost to quantization at a GEMM's own shape (NVIDIA, "Matrix
  Multiplication Background User's Guide", tile and wave quantization): the output is cut into
  TILE_M x TILE_N tiles, one per SM at a time, and every wave of tiles costs as much as a full one
  (fewer tiles than SMs are split along k over all of them, as cuBLAS's split-k kernels do).
  A GEMM whose operands take longer to stream from HBM than to multiply runs at the bandwidth.
- attention: the forward and backward rates that FlashAttention-3's paper measured on an H100 SXM5
  for each kernel (FlashAttention-2, cuDNN, FlashAttention-3, and unfused "standard attention"), by
  sequence length, head dim 128 (Shah et al. 2024, arXiv 2407.08608, Figs. 5-6, bf16); other
  devices scale them by their bf16 MAMF over the H100's.
- elementwise work and the optimizer: memory traffic at the datasheet HBM bandwidth (perf/kernels.py
  counts the bytes).
- kernel launches: the host submits each kernel in turn, LAUNCH_S apiece (perf/kernels.py counts a
  step's), so a step of short kernels runs at the host's pace.

A device without a published MAMF takes its datasheet peak times MAMF_FRACTION_WITHOUT_MEASUREMENT,
and says so in its `source`.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

TERA = 1e12
LAUNCH_S = 5e-6
"""One kernel launch on the host: 4-6 us from the CPU's call to the GPU's start, measured with CUDA 13 on
an RTX 5070 Ti (susun-blog.com, "pegainfer (3): From Launch Overhead to CUDA Graph"). A lower bound of
what an eager PyTorch operator costs the host: its dispatch comes on top."""
TILE_M, TILE_N = 128, 256
"""The output tile of cuBLAS's large Hopper and Ampere bf16 kernels; a GEMM takes whichever
orientation of it wastes less."""
DEFAULT_SMS = 132
"""Waves of a GPU outside the catalog (a measured profile's name): an H100's SMs."""
MAMF_FRACTION_WITHOUT_MEASUREMENT = 0.803
"""bf16 MAMF over peak, the median of the table's NVIDIA rows (A100 SXM 86.9%, GH200 83.8%, A100 PCIe
81.1%, H100 SXM 80.3%, B300 78.6%, B200 77.6%, GB200 72.9%): for a catalog device nobody has measured."""


@dataclass(frozen=True)
class GpuKernels:
    sms: int
    """Streaming multiprocessors (AMD: compute units): how many tiles run in one wave."""
    mamf: dict[str, float]
    """Maximum achievable matmul FLOP/s by dtype (bf16, fp8); absent: the peak x MAMF_FRACTION_WITHOUT_MEASUREMENT."""
    source: str


KERNELS: dict[str, GpuKernels] = {
    "H100-SXM-80GB": GpuKernels(132, {"bf16": 794.5 * TERA, "fp8": 1402.6 * TERA}, "MAMF table (H100 SXM)"),
    "H200-141GB": GpuKernels(132, {"bf16": 794.5 * TERA, "fp8": 1453.4 * TERA},
                             "MAMF table (H100 SXM row: 'H200 is the same'; H200 SXM fp8 row)"),
    "H800-SXM-80GB": GpuKernels(132, {"bf16": 794.5 * TERA, "fp8": 1402.6 * TERA},
                                "H100 SXM's MAMF: the same SXM5 die and clocks, only NVLink differs"),
    "H100-PCIe-80GB": GpuKernels(114, {}, "no MAMF measured"),
    "A100-SXM-80GB": GpuKernels(108, {"bf16": 271.2 * TERA}, "MAMF table (A100 SXM)"),
    "A100-40GB": GpuKernels(108, {"bf16": 271.2 * TERA}, "MAMF table (A100 SXM)"),
    "L40S": GpuKernels(142, {}, "no MAMF measured"),
    "RTX-4090": GpuKernels(128, {"bf16": 178.5 * TERA},
                           "mag-/gpu_benchmark README (a MAMF search; bf16 against the 165 TFLOPS datasheet "
                           "figure with fp32 accumulate: its boost clocks exceed the datasheet's)"),
    "MI300X": GpuKernels(304, {"bf16": 668.4 * TERA}, "MAMF table (MI300X, TunableOp)"),
    "MI325X": GpuKernels(304, {"bf16": 784.9 * TERA}, "MAMF table (MI325X, TunableOp, 1000 W)"),
    "B200": GpuKernels(148, {"bf16": 1745.0 * TERA, "fp8": 3432.5 * TERA}, "MAMF table (B200 SXM)"),
    "GB200": GpuKernels(148, {"bf16": 1822.0 * TERA, "fp8": 3615.6 * TERA}, "MAMF table (GB200)"),
    "B300": GpuKernels(160, {"bf16": 1769.0 * TERA, "fp8": 3353.3 * TERA}, "MAMF table (B300 SXM)"),
    "L4": GpuKernels(58, {}, "no MAMF measured"),
    "RTX-A6000": GpuKernels(84, {}, "no MAMF measured"),
    "MI355X": GpuKernels(256, {"bf16": 1565.0 * TERA},
                         "MAMF table (MI355X; against its 'Theory' of 2,300 there, the AMD page's dense 2,500 here)"),
    "H20": GpuKernels(78, {}, "no MAMF measured"),
    "A10G": GpuKernels(72, {}, "no MAMF measured (the A10's SMs)"),
    "RTX-5090": GpuKernels(170, {}, "no MAMF measured"),
    "RTX-3090": GpuKernels(82, {}, "no MAMF measured"),
}
"""SM counts from the vendors' architecture whitepapers (Hopper, Ampere, Ada, Blackwell, CDNA 3 and 4); the
H20's from a Geekbench report (hardware.py's sources), the A10G's taken as the A10's."""

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_H100: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # kernel: (forward TFLOP/s, backward TFLOP/s) at SEQ_LENS; H100 SXM5, bf16, head dim 128
    "flash": ((309, 350, 362, 368, 370, 370), (214, 260, 291, 310, 318, 322)),  # FlashAttention-2
    "cudnn": ((497, 574, 617, 609, 600, 595), (305, 408, 465, 499, 518, 516)),
    "flash3": ((467, 565, 625, 638, 646, 648), (316, 424, 501, 542, 559, 561)),
    "math": ((74, 100, 119, 133, 139, 139), (104, 131, 159, 174, 181, 181)),  # unfused; 16K ran out of memory
}
"""FlashAttention-3 paper, Figs. 5-6 (the bars' labels). Beyond 16K a kernel keeps its 16K rate;
below 512, its 512 rate. The memory-efficient kernel was not measured there: FlashAttention-2's."""
H100_BF16_MAMF = KERNELS["H100-SXM-80GB"].mamf["bf16"]


def kernels_of(gpu: str) -> GpuKernels | None:
    return KERNELS.get(gpu)


def mamf(gpu: str, dtype: str, peaks: dict[str, float]) -> float:
    """The device's maximum achievable matmul rate for `dtype`, given its datasheet `peaks` by dtype:
    the measured one (fp16 reads bf16's); else the dtype's peak times the fraction of its peak the
    device's bf16 MAMF reaches, or MAMF_FRACTION_WITHOUT_MEASUREMENT where nothing was measured."""
    known = KERNELS[gpu].mamf if gpu in KERNELS else {}
    key = "bf16" if dtype == "fp16" else dtype
    if key in known:
        return known[key]
    fraction = known["bf16"] / peaks["bf16"] if "bf16" in known else MAMF_FRACTION_WITHOUT_MEASUREMENT
    return peaks[dtype] * fraction


def gemm_seconds(m: int, k: int, n: int, rate: float, sms: int, bytes_per_element: float,
                 hbm_bytes_per_s: float) -> float:
    """One (m x k) @ (k x n) GEMM: its waves of output tiles at `rate` per full wave, or the time to
    stream its operands and output through HBM, whichever is longer."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0

    def waves(tm: int, tn: int) -> float:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        return tiles / sms if tiles < sms else math.ceil(tiles / sms)  # fewer tiles than SMs: split over k

    full_waves = min(waves(TILE_M, TILE_N), waves(TILE_N, TILE_M))
    compute = full_waves * sms * TILE_M * TILE_N * 2 * k / rate
    memory = (m * k + k * n + m * n) * bytes_per_element / hbm_bytes_per_s
    return max(compute, memory)


def gemm_passes_seconds(m: int, k: int, n: int, rate: float, sms: int, bytes_per_element: float,
                        hbm_bytes_per_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of a linear layer's GEMMs: the forward (m x k) @ (k x n); the input
    gradient (m x n) @ (n x k) and the weight gradient (k x m) @ (m x n)."""
    args = (rate, sms, bytes_per_element, hbm_bytes_per_s)
    return gemm_seconds(m, k, n, *args), gemm_seconds(m, n, k, *args) + gemm_seconds(k, m, n, *args)


@functools.lru_cache(maxsize=4096)
def gemms_rate(shapes: tuple[tuple[int, int, int, int], ...], rate: float, sms: int, bytes_per_element: float,
               hbm_bytes_per_s: float) -> float:
    """FLOPs over seconds of linear layers' three passes, each (m, k, n, times) run `times` times: the
    rate their FLOPs run at together. Cached: the planner times thousands of layouts of a few shapes."""
    work = seconds = 0.0
    for m, k, n, times in shapes:
        fwd, bwd = gemm_passes_seconds(m, k, n, rate, sms, bytes_per_element, hbm_bytes_per_s)
        work, seconds = work + times * 6 * m * k * n, seconds + times * (fwd + bwd)
    return work / seconds if seconds else 1.0


def attention_rates(kernel: str, seq_len: int, bf16_mamf: float) -> tuple[float, float]:
    """(forward, backward) FLOP/s of `kernel` at `seq_len` (the nearest measured length below it, or
    the shortest), scaled from the H100 by the device's bf16 MAMF."""
    forward, backward = ATTENTION_H100[kernel]
    i = max(0, bisect.bisect_right(SEQ_LENS, seq_len) - 1)
    scale = bf16_mamf / H100_BF16_MAMF
    return forward[i] * TERA * scale, backward[i] * TERA * scale
