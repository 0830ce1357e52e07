"""Does this device multiply in fp8 faster than in bf16? A probe bounded in time, run by fp8-mixed
training before step 1 (train/trainer.py) and by `trainfit calibrate` (calibrate/machine.py).

fp8 training exists to run its GEMMs faster than bf16's, on fp8 tensor cores (H100, H200, MI300X...).
Elsewhere torch._scaled_mm may still run, on a reference kernel: some CPUs multiply fp8 orders of
magnitude slower than bf16 (benchmarks/README.md has the rates measured), and an fp8 run there is
slower by as much, silently. The probe times one small GEMM of each kind, as the run computes it:
fp8 e4m3 operands through torch._scaled_mm, the way torchao's float8 linear calls it (the input
row-major, the weight column-major, fp32 scales per tensor or per row and column, bf16 out), and
bf16 through F.linear (bf16-mixed's linear under autocast).

Bounded: up to ROUNDS calls of each, alternating, and none of a kernel once its calls have run
`deadline_s`; a first call longer than the deadline is itself the measurement. Each kernel's calls
thus take at most about twice the deadline (a call just under it, then one more), or one call
where that alone is longer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainfit.config import field_error

PROBE_SHAPE = (128, 128, 128)
"""(m, k, n) of the probe's GEMMs: every dim a multiple of 16 (torch._scaled_mm's rule), small enough
that one call of a reference kernel, the slowest fp8 GEMM there is, takes a fraction of a second."""
DEADLINE_S = 0.1
"""A kernel is called no more once this many seconds of its calls have run."""
ROUNDS = 10
"""Calls of each kernel at most, alternating; the fastest one is the measurement (on a machine shared
with other work, a call now and then waits for a core many times its own length)."""
SLOW_FACTOR = 10.0
"""fp8 counts as slow below bf16's rate / SLOW_FACTOR: a reference kernel, no fp8 hardware. A device
with fp8 GEMMs in hardware (or vector units that emulate them) runs them within a small factor of
bf16's, and so do timings disturbed by the machine: at a shape this small a GPU runs either in
about one kernel launch, and a CPU whose cores are busy with other work makes each call wait about
a scheduler slice per parallel region, of which fp8's kernel has more than bf16's. A reference
kernel is orders of magnitude slower."""
FIX = ("use precision.mode=bf16-mixed on this machine; fp8 is for GPUs with fp8 tensor cores "
       "(H100, H200, MI300X ...)")


@dataclass(frozen=True)
class Fp8MatmulRates:
    """What the probe measured on one device."""

    device: str
    scaling: str
    """tensorwise | rowwise: the scales torch._scaled_mm was given."""
    shape: tuple[int, int, int]
    fp8_flops_per_s: float
    bf16_flops_per_s: float

    @property
    def slow(self) -> bool:
        """fp8 below bf16's rate by more than SLOW_FACTOR: this device has no fp8 GEMM hardware."""
        return fp8_is_slow(self.fp8_flops_per_s, self.bf16_flops_per_s)

    @property
    def shape_text(self) -> str:
        return " x ".join(map(str, self.shape))

    def note(self) -> str:
        return (f"fp8 matmul probe ({self.device}, {self.shape_text}, {self.scaling} scales): fp8 "
                f"{gflops(self.fp8_flops_per_s)} GFLOP/s, bf16 {gflops(self.bf16_flops_per_s)} GFLOP/s")

    def warning(self) -> str:
        return (f"precision.mode='fp8-mixed': fp8 matmuls run at {gflops(self.fp8_flops_per_s)} GFLOP/s on this "
                f"{self.device} against bf16's {gflops(self.bf16_flops_per_s)} GFLOP/s (torch._scaled_mm against "
                f"F.linear, {self.shape_text}): it has no fp8 hardware, and every step's float8 linears run about "
                f"{self.bf16_flops_per_s / self.fp8_flops_per_s:,.0f}x slower than bf16's would; {FIX}")

    def record(self) -> dict[str, object]:
        """The metrics.jsonl fields."""
        return {"fp8_matmul_flops_per_s": self.fp8_flops_per_s, "bf16_matmul_flops_per_s": self.bf16_flops_per_s,
                "fp8_probe_shape": "x".join(map(str, self.shape)), "fp8_probe_scaling": self.scaling}


def fp8_is_slow(fp8_flops_per_s: float, bf16_flops_per_s: float) -> bool:
    """fp8 GEMMs below bf16's rate by more than SLOW_FACTOR (see there)."""
    return fp8_flops_per_s * SLOW_FACTOR < bf16_flops_per_s


def gflops(flops_per_s: float) -> str:
    """A rate in GFLOP/s for people: one decimal from 1 up, two significant digits below (0.045)."""
    g = flops_per_s / 1e9
    return f"{g:,.1f}" if g >= 1 else f"{g:.2g}"


def fp8_matmul(m: int, k: int, n: int, device: torch.device | str, scaling: str = "tensorwise"
               ) -> Callable[[], torch.Tensor]:
    """(m x k) @ (k x n) in fp8 as torchao's float8 linear runs its forward: e4m3 operands, the input
    row-major and the weight (n x k) transposed, i.e. column-major (torch._scaled_mm requires it),
    fp32 inverse scales (tensorwise: one per tensor; rowwise: one per row of the input and per column
    of the weight), bf16 out, fast accumulation (torchao's forward GEMM config)."""
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
    if scaling == "rowwise":
        scale_a, scale_b = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    else:
        scale_a = scale_b = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)


def bf16_matmul(m: int, k: int, n: int, device: torch.device | str) -> Callable[[], torch.Tensor]:
    """(m x k) @ (k x n) in bf16 as a linear layer runs it: F.linear with an (n x k) weight."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    return lambda: F.linear(x, w)


def interleaved_best_seconds(calls: list[Callable[[], object]], sync: Callable[[], None], *,
                             deadline_s: float = DEADLINE_S, rounds: int = ROUNDS) -> list[float]:
    """The fastest call of each of `calls`, over up to `rounds` rounds of one call of each in turn (a
    busy moment of the machine slows them alike), the first a warm-up that also counts. A call stops
    being made once its own calls have run `deadline_s`: a warm-up past the deadline is its answer
    (the rate is that low or lower)."""
    best, spent = [float("inf")] * len(calls), [0.0] * len(calls)
    for _ in range(rounds):
        active = [i for i in range(len(calls)) if spent[i] <= deadline_s]
        if not active:
            break
        for i in active:
            start = time.perf_counter()
            calls[i]()
            sync()
            seconds = time.perf_counter() - start
            spent[i] += seconds
            best[i] = min(best[i], seconds)
    return best


def probe_fp8_matmul(device: torch.device | str, scaling: str = "tensorwise", *,
                     shape: tuple[int, int, int] = PROBE_SHAPE, deadline_s: float = DEADLINE_S) -> Fp8MatmulRates:
    """Time torch._scaled_mm against bf16 F.linear at `shape` on `device` (module docstring). Raises a
    ConfigError naming precision.mode when torch._scaled_mm cannot run there."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    m, k, n = shape
    try:
        fp8, bf16 = interleaved_best_seconds([fp8_matmul(m, k, n, device, scaling), bf16_matmul(m, k, n, device)],
                                             sync, deadline_s=deadline_s)
    except (RuntimeError, NotImplementedError) as err:
        raise field_error("precision.mode", "fp8-mixed",
                          f"torch._scaled_mm cannot run on this {device.type} ({str(err).splitlines()[0]}); "
                          f"{FIX}") from err
    return Fp8MatmulRates(device.type, scaling, shape, 2 * m * k * n / fp8, 2 * m * k * n / bf16)
