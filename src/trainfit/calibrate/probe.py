"""The timing loops of every calibration measurement (one rank's, and ranks' in step), and the
compute probe: what one rank's fp32 matmuls and memory copies run at, alone
(trainfit.calibrate.machine) or while every rank of one machine runs it at once
(trainfit.calibrate.comms's ranks). Imports torch."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MAX_CALLS = 200
"""Calls per batch at most of synchronized_median_seconds (the smallest collectives take ~0.1 ms)."""
PROBE_GEMM = (2048, 256, 1024)
"""(m, k, n) of the probe's matmul: a mid-sized transformer GEMM (tokens x dim by dim x 4 dim)."""


WARM_CALLS = 3
"""Timed calls warm_seconds takes the fastest of: one call preempted by another process would
otherwise size every batch of the measurement at a fraction of its calls."""


def warm_seconds(call: Callable[[], object], sync: Callable[[], None], *, batch_s: float | None) -> float:
    """Seconds of one call after an untimed one (the fastest of WARM_CALLS; one only where a call
    already fills `batch_s`, so a batch is one call whatever the others take; always WARM_CALLS where
    `batch_s` is None, as ranks making a collective together need the same count). A kernel's first call
    pays once for what later calls reuse (cuBLAS's handle, autotuning, lazily loaded kernels, the
    allocator's growth, a collective's connections): timed, it would size the batches at a fraction
    of the calls they should hold."""
    call()
    sync()
    fastest = float("inf")
    for _ in range(WARM_CALLS):
        start = time.perf_counter()
        call()
        sync()
        fastest = min(fastest, time.perf_counter() - start)
        if batch_s is not None and fastest >= batch_s:
            break
    return fastest


def median_seconds(call: Callable[[], object], sync: Callable[[], None], *, batch_s: float, repeats: int) -> float:
    """Median over `repeats` batches of back-to-back calls of the mean seconds per call, the batches
    sized by a warm call (warm_seconds). The median, not the best: the time model predicts a step's
    median time, which runs under the machine's usual disturbances, not its quietest moment."""
    calls = max(1, round(batch_s / warm_seconds(call, sync, batch_s=batch_s)))
    batches = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        batches.append((time.perf_counter() - start) / calls)
    return statistics.median(batches)


def compute_probe(device: torch.device, *, copy_bytes: int, batch_s: float, repeats: int,
                  together: bool = False) -> tuple[float, float]:
    """(fp32 matmul FLOP/s at PROBE_GEMM, copy bytes/s read + written over `copy_bytes` tensors), of
    one rank alone, or `together`: every rank of the default process group runs the same calls at
    once and each batch lasts until the slowest rank's ends, as a synchronous step does (ranks
    time-sharing cores rotate, so this is the machine's throughput shared out)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def seconds(call: Callable[[], object]) -> float:
        if together:
            return synchronized_median_seconds(call, device, batch_s=batch_s, repeats=repeats)
        return median_seconds(call, sync, batch_s=batch_s, repeats=repeats)

    m, k, n = PROBE_GEMM
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    matmul = seconds(lambda: a @ b)
    src, dst = torch.ones(copy_bytes // 4, device=device), torch.empty(copy_bytes // 4, device=device)
    copy = seconds(lambda: dst.copy_(src))
    return 2 * m * k * n / matmul, 2 * copy_bytes / copy


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def synchronized_median_seconds(call: Callable[[], object], device: torch.device, *, batch_s: float,
                                repeats: int) -> float:
    """median_seconds of a call every rank of the default process group makes together (a collective,
    a tensor-parallel step): each batch's time is the slowest rank's, and every rank runs the same
    number of calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warm = _slowest(warm_seconds(call, sync, batch_s=None), device)
    calls = max(1, min(MAX_CALLS, round(batch_s / warm)))
    batches = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        sync()
        batches.append(_slowest((time.perf_counter() - start) / calls, device))
    return statistics.median(batches)
