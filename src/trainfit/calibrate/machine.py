"""`trainfit calibrate`: measure this machine and return its HardwareProfile; imports torch (this
command only: perf/, which reads the profile, stays torch-free).

What it measures, on the device training would use (cuda when present, else cpu), with torch
computing on `threads` threads (what `trainfit train` uses in the same environment: torch's default,
or OMP_NUM_THREADS; torchrun sets 1 per rank):
- matmuls, F.linear as the model runs them, and its backward's two GEMMs (input and weight
  gradients, whose layouts bf16/fp16 CPU kernels run up to 6x slower or 2x faster), per dtype
  (fp32, bf16, fp16; fp8 forward only, through torch._scaled_mm where it runs) over GEMMs of
  transformer layers: tokens x dim by dim x dim and by dim x 4 dim, small to large. A dtype's rate
  is its best shape's. A shape whose one call would take longer than `max_call_s` at the dtype's
  rate so far is skipped: bf16 and fp16 matmuls run many times slower than fp32 on CPUs without
  native support for them (docs/commands/calibrate.md). fp8 starts with the probe fp8-mixed
  training runs (trainfit.fp8_matmul: one small GEMM, bounded in time, against bf16's): where fp8
  runs below a tenth of bf16's rate (a reference kernel, orders of magnitude slower: no fp8
  hardware) the probe's shape is the profile's one fp8 shape, else fp8's rate so far is the probe's
  or a tenth of bf16's best, the higher (a GPU runs the probe's small GEMM in about a kernel
  launch's time, far below its rate at the grid's shapes);
- causal attention, forward and backward through scaled_dot_product_attention (the kernel training
  picks), per dtype over (batch, heads, sequence, head dim) shapes, skipped as the matmuls are;
- memory bandwidth: a large fp32 copy (read + write bytes) and add (two reads, one write), the better;
- collectives at 2..max_ranks ranks (trainfit.calibrate.comms: spawned processes, fits);
- concurrency: a probe (trainfit.calibrate.probe: an fp32 matmul and a copy) alone, then on
  every rank of each world size at once, in step (each batch lasts until the slowest rank's ends,
  as a synchronous step does); its rates over the lone one's say how much a rank slows down while
  the machine's other ranks compute (caches, memory bandwidth, and beyond the cores the cores);
- the host work of DTensor's dispatch (tensor parallelism, with and without sequence parallelism)
  and of FSDP2's hooks, per block and for the rest of a tiny model, on the same ranks where they do
  not outnumber the cores (trainfit.calibrate.host; beyond, the time model time-shares it);
- AdamW's step on fp32 parameters (the master weights' dtype) of a few sizes, fused (where
  train/optim.py uses it) and foreach, each fitted to step_s + s_per_param x parameters.
Every figure is the median of `repeats` timed batches of back-to-back calls, each about `batch_s`
long (sustained within a batch; the median, as the time model predicts median step times), their
length in calls set by a call made after an untimed first one (probe.warm_seconds).
The shapes, sizes and time limits are the device type's (trainfit.calibrate.settings: a GPU
measures GPU-sized work); on a GPU, a shape or message whose tensors would not fit the free memory
is skipped with a warning.
"""

from __future__ import annotations

import datetime
import os
import platform
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.table import Table

from trainfit.calibrate.comms import fit_collectives, fit_nonnegative, measure_collectives, predicted_seconds
from trainfit.calibrate.probe import compute_probe, median_seconds
from trainfit.calibrate.settings import (
    Settings,
    attention_bytes,
    fits,
    matmul_bytes,
    message_rank_bytes,
    settings_for,
)
from trainfit.config import ConfigError
from trainfit.fp8_matmul import SLOW_FACTOR, fp8_is_slow, fp8_matmul, gflops, probe_fp8_matmul
from trainfit.hardware_profile import (
    MATMUL_DTYPES,
    PROFILE_VERSION,
    AttentionShape,
    Concurrency,
    HardwareProfile,
    HostOverhead,
    Machine,
    MatmulBackward,
    MatmulShape,
    OptimizerFit,
)
from trainfit.optimizer_spec import FUSED_DEVICES
from trainfit.perf.flops import FLASH_ATTENTION_BWD_FACTOR
from trainfit.units import fmt_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 4}
"""Bytes per element of a dtype's operands, for the memory check (fp8's are made from fp32 ones)."""
OPTIMIZER_TENSORS = 8
"""Each optimizer size is split into this many equal parameters (a step's per-tensor cost is in step_s)."""

Progress = Callable[[str, int, int], None]
"""progress(what starts now, steps done, steps in all)."""


def _device_type() -> str:
    """The device training would use: cuda when present, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_max_ranks(max_ranks: int | None) -> int:
    """Default: CPU up to 4 ranks, one per core (at least 2); CUDA up to 4 GPUs. 1 skips the
    collectives; on CUDA each rank needs its own GPU."""
    device = _device_type()
    if max_ranks is None:
        return min(4, torch.cuda.device_count()) if device == "cuda" else max(2, min(4, os.cpu_count() or 1))
    if max_ranks < 1:
        raise ConfigError(f"--max-ranks {max_ranks}: must be >= 1 (1 skips the collectives, 2 or more "
                          "measures them at 2..N ranks)")
    if device == "cuda" and max_ranks > torch.cuda.device_count():
        raise ConfigError(f"--max-ranks {max_ranks}: this machine has {torch.cuda.device_count()} GPU(s), one per "
                          "rank; use at most that many")
    return max_ranks


def calibrate(*, quick: bool = False, max_ranks: int | None = None, threads: int = 1,
              progress: Progress = lambda what, done, total: None) -> HardwareProfile:
    """Measure this machine (module docstring); `quick` takes seconds instead of a minute or two;
    collectives at 2..max_ranks ranks (default: see resolve_max_ranks)."""
    device, max_ranks = _device_type(), resolve_max_ranks(max_ranks)
    settings = settings_for(device, quick=quick)
    impls = ["fused", "foreach"] if device in FUSED_DEVICES else ["foreach"]
    worlds = range(2, max_ranks + 1)
    total = ((len(MATMUL_DTYPES) + 1) * 2 * len(settings.shapes) + 1  # fp8 too (where it runs), after its probe
             + len(MATMUL_DTYPES) * (2 * len(settings.shapes) + len(settings.attention_shapes)) + 1
             + len(worlds) + len(impls) * len(settings.optimizer_params))
    done = 0

    def step(what: str) -> None:
        nonlocal done
        progress(what, done, total)
        done += 1

    start, threads_before, cores = time.perf_counter(), torch.get_num_threads(), os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        shapes = [s for dtype in MATMUL_DTYPES for s in _matmuls(dtype, device, settings, step)]
        shapes += _fp8_matmuls(device, settings, step,
                               bf16_flops_per_s=max((s.flops_per_s for s in shapes if s.dtype == "bf16"), default=0.0))
        backward = [b for dtype in MATMUL_DTYPES for b in _matmul_backwards(dtype, device, settings, step)]
        attention = [a for dtype in MATMUL_DTYPES for a in _attentions(dtype, device, settings, step)]
        step("memory bandwidth")
        memory = _memory_bandwidth(device, settings)
        alone = compute_probe(torch.device(device), copy_bytes=settings.memory_bytes, batch_s=settings.batch_s,
                              repeats=settings.repeats)
        measured, concurrency, host = {}, [], []
        messages = _fitting_messages(settings.message_bytes, device) if worlds else ()
        for n in worlds:
            step(f"collectives at {n} ranks ({'nccl' if device == 'cuda' else 'gloo'}, spawning)")
            ranks = measure_collectives(n, device, threads=threads, sizes=messages,
                                        batch_s=settings.batch_s, repeats=settings.repeats,
                                        copy_bytes=settings.memory_bytes,
                                        time_shared=device == "cpu" and n * threads > cores)
            measured[n] = ranks.points
            concurrency.append(Concurrency(n, ranks.probe[0] / alone[0], ranks.probe[1] / alone[1]))
            for kind, (block, root) in (ranks.host_overhead or {}).items():
                host.append(HostOverhead(n, kind, block, root))
        optimizer = [_optimizer(impl, device, settings, step) for impl in impls]
    finally:
        torch.set_num_threads(threads_before)
    progress("done", total, total)
    link, collectives = fit_collectives(measured) if measured else (None, [])
    best = {d: max(s.flops_per_s for s in shapes if s.dtype == d) for d in dict.fromkeys(s.dtype for s in shapes)}
    machine = Machine(device=device, name=_device_name(device), cores=cores, threads=threads,
                      torch=torch.__version__, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      quick=quick, seconds=round(time.perf_counter() - start, 1))
    return HardwareProfile(version=PROFILE_VERSION, machine=machine, matmul_flops_per_s=best,
                           matmul_shapes=tuple(shapes), memory_bytes_per_s=memory, optimizer=tuple(optimizer),
                           link=link, collectives=tuple(collectives), attention=tuple(attention),
                           matmul_backward=tuple(backward), concurrency=tuple(concurrency),
                           host_overhead=tuple(host))


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:  # Linux: the model name; platform.processor() is often empty there
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def _free_bytes(device: str) -> int | None:
    """CUDA: the GPU's free memory, the allocator's cache released first; None on a CPU, whose
    settings are small and whose memory is not checked."""
    if device != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _fits(device: str, nbytes: int, what: str) -> bool:
    """Whether `what` (needing `nbytes`) fits the device's free memory; a warning names it where not."""
    free = _free_bytes(device)
    if fits(nbytes, free):
        return True
    warnings.warn(f"calibrate: {what} skipped: its tensors take about {fmt_bytes(nbytes)} and this GPU has "
                  f"{fmt_bytes(free)} free; the profile has no figure for it", stacklevel=2)
    return False


def _fitting_messages(sizes: tuple[int, ...], device: str) -> tuple[int, ...]:
    """The message sizes whose buffers fit a rank's GPU (the first GPU's free memory, where the
    ranks' first one runs beside this process)."""
    return tuple(b for b in sizes if _fits(device, message_rank_bytes(b), f"collectives of {b / 2**20:,.0f} MiB"))


# ---------------------------------------------------------------- matmuls


def _matmul(dtype: str, m: int, k: int, n: int, device: str) -> Callable[[], torch.Tensor]:
    """(m x k) @ (k x n) as a linear layer runs it: F.linear with an (n x k) weight; fp8 through
    torch._scaled_mm as torchao's tensorwise float8 linear calls it (trainfit.fp8_matmul)."""
    if dtype == "fp8":
        return fp8_matmul(m, k, n, device)
    x = torch.randn(m, k, device=device, dtype=DTYPES[dtype])
    w = torch.randn(n, k, device=device, dtype=DTYPES[dtype])
    return lambda: F.linear(x, w)


def _fp8_matmuls(device: str, s: Settings, step: Callable[[str], None], *,
                 bf16_flops_per_s: float = 0.0) -> list[MatmulShape]:
    """fp8's shapes, after the probe fp8-mixed training runs (trainfit.fp8_matmul: one small GEMM,
    bounded in time, against bf16's): where it says fp8 is slow (below a tenth of bf16's rate: a
    reference kernel, no fp8 hardware) the probe's shape alone, else the grid's shapes that fit at
    the probe's rate or a tenth of bf16's best (`bf16_flops_per_s`), the higher, and above; none
    where torch._scaled_mm cannot run."""
    step("fp8 matmul probe")
    try:
        rates = probe_fp8_matmul(device)
    except ConfigError:
        return []
    probe = MatmulShape("fp8", *rates.shape, rates.fp8_flops_per_s)
    if rates.slow:
        return [probe]
    return _matmuls("fp8", device, s, step, probe=probe, known_flops_per_s=bf16_flops_per_s / SLOW_FACTOR)


def _grid(s: Settings) -> list[tuple[int, int, int]]:
    """(m, k, n) of tokens x dim by dim x dim and by dim x 4 dim, smallest first."""
    return sorted({(m, d, n) for m, d in s.shapes for n in (d, 4 * d)}, key=lambda mkn: mkn[0] * mkn[1] * mkn[2])


def _matmuls(dtype: str, device: str, s: Settings, step: Callable[[str], None], *,
             probe: MatmulShape | None = None, known_flops_per_s: float = 0.0) -> list[MatmulShape]:
    """Every shape of the grid that fits in max_call_s at the dtype's rate so far (from `probe`, a
    small shape measured first, and `known_flops_per_s`, a rate the dtype reaches, where given),
    smallest first; the probe alone where none fits."""
    out: list[MatmulShape] = []
    for m, k, n in _grid(s):
        step(f"matmul {dtype} {m} x {k} x {n}")
        flops = 2 * m * k * n
        rate = max([known_flops_per_s, *(o.flops_per_s for o in [*out, *([probe] if probe else [])])])
        if rate and flops / rate > s.max_call_s:
            continue
        if not _fits(device, matmul_bytes(m, k, n, ITEMSIZE[dtype]), f"matmul {dtype} {m} x {k} x {n}"):
            continue
        seconds = median_seconds(_matmul(dtype, m, k, n, device), _sync(device), batch_s=s.batch_s, repeats=s.repeats)
        out.append(MatmulShape(dtype, m, k, n, flops / seconds))
    return out or ([probe] if probe else [])


def _matmul_backwards(dtype: str, device: str, s: Settings, step: Callable[[str], None]) -> list[MatmulBackward]:
    """A linear layer's two backward GEMMs per shape of the grid, skipped past max_call_s as forwards are."""
    out: list[MatmulBackward] = []
    for m, k, n in _grid(s):
        step(f"matmul backward {dtype} {m} x {k} x {n}")
        flops = 2 * m * k * n
        if out and flops / min(min(b.input_grad_flops_per_s, b.weight_grad_flops_per_s) for b in out) > s.max_call_s:
            continue
        if not _fits(device, matmul_bytes(m, k, n, ITEMSIZE[dtype]), f"matmul backward {dtype} {m} x {k} x {n}"):
            continue
        input_grad, weight_grad = _backward_seconds(dtype, m, k, n, device, s)
        out.append(MatmulBackward(dtype, m, k, n, flops / input_grad, flops / weight_grad))
    return out


def _backward_seconds(dtype: str, m: int, k: int, n: int, device: str, s: Settings) -> tuple[float, float]:
    """Seconds of a linear layer's input-gradient and weight-gradient GEMMs; their tensors are freed
    on return, before the next shape's memory check."""
    x, w, grad = (torch.randn(*shape, device=device, dtype=DTYPES[dtype]) for shape in ((m, k), (n, k), (m, n)))
    sync = _sync(device)
    return (median_seconds(lambda: grad @ w, sync, batch_s=s.batch_s, repeats=s.repeats),
            median_seconds(lambda: grad.t() @ x, sync, batch_s=s.batch_s, repeats=s.repeats))


def _attention(dtype: str, shape: tuple[int, int, int, int], device: str) -> Callable[[], None]:
    """Causal attention of (batch, heads, seq, head dim) query, key and value, forward then backward."""
    q, k, v = (torch.randn(shape, device=device, dtype=DTYPES[dtype], requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=DTYPES[dtype])
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)


def _attentions(dtype: str, device: str, s: Settings, step: Callable[[str], None]) -> list[AttentionShape]:
    """Causal attention forward + backward per shape, smallest first, skipped past max_call_s as matmuls are."""
    out: list[AttentionShape] = []
    for batch, heads, seq, head_dim in sorted(s.attention_shapes, key=lambda b: b[0] * b[1] * b[2] ** 2 * b[3]):
        step(f"attention {dtype} {batch} x {heads} heads x {seq} x {head_dim}")
        forward = 2 * 2 * heads * head_dim * seq // 2 * batch * seq  # block_cost.block_attention_flops x tokens
        flops = forward * (1 + FLASH_ATTENTION_BWD_FACTOR)
        if out and flops / max(a.flops_per_s for a in out) > s.max_call_s:
            continue
        shape = (batch, heads, seq, head_dim)
        if not _fits(device, attention_bytes(shape, ITEMSIZE[dtype]), f"attention {dtype} {batch} x {heads} heads "
                                                                       f"x {seq} x {head_dim}"):
            continue
        seconds = median_seconds(_attention(dtype, shape, device), _sync(device), batch_s=s.batch_s,
                                 repeats=s.repeats)
        out.append(AttentionShape(dtype, batch, heads, seq, head_dim, flops / seconds))
    return out


# ---------------------------------------------------------------- memory and optimizer


def _memory_bandwidth(device: str, s: Settings) -> float:
    a, b, c = (torch.ones(s.memory_bytes // 4, device=device) for _ in range(3))
    copy = median_seconds(lambda: c.copy_(a), _sync(device), batch_s=s.batch_s, repeats=s.repeats)
    add = median_seconds(lambda: torch.add(a, b, out=c), _sync(device), batch_s=s.batch_s, repeats=s.repeats)
    return max(2 * s.memory_bytes / copy, 3 * s.memory_bytes / add)


def _optimizer(impl: str, device: str, s: Settings, step: Callable[[str], None]) -> OptimizerFit:
    points = []
    for size in s.optimizer_params:
        step(f"AdamW {impl}, {size:,} parameters")
        params = [torch.nn.Parameter(torch.randn(size // OPTIMIZER_TENSORS, device=device))
                  for _ in range(OPTIMIZER_TENSORS)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=impl == "fused", foreach=impl == "foreach" or None)
        opt.step()  # creates the states
        points.append((size, median_seconds(opt.step, _sync(device), batch_s=s.batch_s, repeats=s.repeats)))
    step_s, s_per_param = fit_nonnegative([(1.0, float(p), t) for p, t in points])
    return OptimizerFit("adamw", impl, "fp32", s_per_param, step_s, tuple(p for p, _ in points),
                        tuple(t for _, t in points))


# ---------------------------------------------------------------- tables


def profile_tables(p: HardwareProfile) -> list[Table]:
    """The profile as `trainfit calibrate` prints it: a summary, matmuls per shape, collectives, optimizer."""
    m = p.machine
    summary = Table("measured", "", title=f"hardware profile: {m.device}, {m.name}, {m.threads} thread(s), "
                                          f"torch {m.torch}, {m.seconds:.0f} s{' (quick)' if m.quick else ''}")
    rates = p.matmul_flops_per_s
    for dtype, rate in rates.items():
        summary.add_row(f"matmul {dtype}", f"{gflops(rate)} GFLOP/s")
    if "fp8" in rates and rates["fp8"] < rates["bf16"]:
        ratio = rates["bf16"] / rates["fp8"]
        summary.add_row("fp8 below bf16", (f"{ratio:,.0f}" if ratio >= 10 else f"{ratio:.1f}") + "x slower"
                        + (" (a reference kernel: no fp8 hardware)" if fp8_is_slow(rates["fp8"], rates["bf16"]) else "")
                        + ": fp8-mixed trains slower than bf16-mixed here; use precision.mode=bf16-mixed")
    summary.add_row("memory bandwidth", f"{p.memory_bytes_per_s / 1e9:,.1f} GB/s")
    if p.link:
        summary.add_row("link (all collectives)", f"{p.link.bytes_per_s / 1e9:,.2f} GB/s, "
                                                  f"{p.link.latency_s * 1e6:,.0f} us per step")
    for o in p.optimizer:
        summary.add_row(f"{o.name} {o.impl} step",
                        f"{o.s_per_param * 1e9:.2f} ns per parameter + {o.step_s * 1e3:.2f} ms")

    dtypes = list(p.matmul_flops_per_s)
    matmuls = Table("m x k x n", *dtypes, title="matmul GFLOP/s per shape (tokens x dim x dim, x 4 dim)",
                    caption="-: not measured (one call would take too long at the dtype's rate; fp8's "
                            "probe shape where it was fp8's only one)")
    for shape in sorted({(s.m, s.k, s.n) for s in p.matmul_shapes}, key=lambda mkn: mkn[0] * mkn[1] * mkn[2]):
        shape_rates = {s.dtype: s.flops_per_s for s in p.matmul_shapes if (s.m, s.k, s.n) == shape}
        matmuls.add_row(" x ".join(map(str, shape)), *(gflops(shape_rates[d]) if d in shape_rates else "-"
                                                        for d in dtypes))
    tables = [summary, matmuls]
    if p.attention:
        attention = Table("batch x heads x seq x head dim", *MATMUL_DTYPES,
                          title="causal attention GFLOP/s, forward + backward")
        for shape in dict.fromkeys((a.batch, a.heads, a.seq_len, a.head_dim) for a in p.attention):
            rates = {a.dtype: a.flops_per_s for a in p.attention if (a.batch, a.heads, a.seq_len, a.head_dim) == shape}
            attention.add_row(" x ".join(map(str, shape)), *(f"{rates[d] / 1e9:,.1f}" if d in rates else "skipped"
                                                              for d in MATMUL_DTYPES))
        tables.append(attention)
    if p.collectives:
        comms = Table("kind", "ranks", "GB/s", "latency us", "sizes", "worst fit error",
                      title="collectives: time = a0 + steps x latency + factor x bytes / bandwidth (perf/comms.py)")
        for c in p.collectives:
            error = max(abs(predicted_seconds(c, b) / t - 1) for b, t in zip(c.nbytes, c.seconds, strict=True))
            comms.add_row(c.kind, str(c.world_size), f"{c.bytes_per_s / 1e9:,.2f}", f"{c.latency_s * 1e6:,.0f}",
                          f"{min(c.nbytes) / 2**10:,.0f} KiB - {max(c.nbytes) / 2**20:,.0f} MiB", f"{error:.0%}")
        tables.append(comms)
    if p.concurrency:
        together = Table("ranks computing at once", "matmul", "memory bandwidth",
                         title="each rank's rates while the machine's ranks all compute, against one alone")
        for c in p.concurrency:
            together.add_row(str(c.ranks), f"{c.matmul:.0%}", f"{c.bandwidth:.0%}")
        tables.append(together)
    if p.host_overhead:
        host = Table("ranks", "framework", "per block", "rest of the model",
                     title="host work a parallel framework adds to one forward and backward")
        for h in p.host_overhead:
            host.add_row(str(h.ranks), h.kind.replace("_", " "), f"{h.block_s * 1e3:.1f} ms",
                         f"{h.root_s * 1e3:.1f} ms")
        tables.append(host)
    return tables
