"""The allocator's figures, the ground truth of memory measurement.

On CUDA the caching allocator keeps exact statistics (`max_memory_allocated`). On CPU there is no
such counter, so we ask glibc: `mallinfo2()` reports the bytes the C allocator has handed out
(`uordblks`, heap chunks in use, plus `hblkhd`, large mmapped blocks; PyTorch's CPU tensors come
from `posix_memalign`, so both kinds are counted), read by a TorchDispatchMode after every aten
operator of the forward, the backward (the autograd engine runs CPU backward on the calling
thread, inside the mode) and the optimizer step. Cost: ~5-10 us per operator (+25-30% on a
~25 ms step of ~1000 ops, +3-10% on a 150 ms one): half the Python dispatch round trip, half
mallinfo2, which walks malloc's free lists.

A training step is measured by memory/measured/attribution.py (what `trainfit train`, `measure` and
`report` show): it reads `current_allocated_bytes` after every operator and counts the tensors
alive at the step's start itself, so that memory in use before the step that is no tensor
(library caches, this module's first dispatch mode) stays out of the peak. `measure_peak` is the
bare primitive: any block's largest in-use bytes above its own start.

What the CPU figure misses: temporaries an operator frees before it returns (kernel workspaces).
It is process-wide: other threads' allocations count when they are alive at a sample, and a
library's one-time buffers (BLAS packing, thread pools) count on the first call, so warm up first.
The other threads that allocate during a step are gloo's: its worker threads run collectives with
scratch of their own (a ring all-reduce holds two segments, 0.5 MiB for DDP's 1 MiB first bucket
on 2 ranks) while the calling thread goes on with backward. Whether that scratch is alive at the
peak's sample depends on scheduling (benchmarks/README.md: a 2-rank ZeRO-1 step on a busy machine),
so a CPU measurement waits for every collective as it is
issued (`collectives_completed`): samples then see the calling thread's allocations only, and
the measured step loses its communication overlap (its figures, not its time, are the point). A
GPU measurement needs none of this: NCCL's buffers are not the caching allocator's.

What decides an out-of-memory error on a GPU is more than the allocated peak: the caching allocator
reserves whole segments (`max_memory_reserved`: its fragmentation on top), and outside it sit the
CUDA context, NCCL's communicator buffers and any other process on the device. So a CUDA
measurement also records the step's reserved peak and the device's used bytes at the step's end
(`device_readings`: total - free from cudaMemGetInfo). The CPU has neither figure: they stay None.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class PeakMemory:
    """Filled in by `measure_peak`; `peak_bytes` is final once the context has exited."""

    baseline_bytes: int = 0
    """Bytes in use when the context was entered."""
    peak_bytes: int = 0
    """Largest in-use bytes seen inside the context, minus `baseline_bytes`."""
    num_samples: int = 0
    """Operators sampled (CPU); 0 on CUDA, where the allocator tracks the peak itself."""
    reserved_peak_bytes: int | None = None
    """CUDA: the caching allocator's reserved peak inside the context (absolute); None on CPU."""
    device_used_bytes: int | None = None
    """CUDA: the device's used bytes when the context exited (DeviceReadings); None on CPU."""


@dataclass(frozen=True)
class DeviceReadings:
    """What the device holds beyond the allocated bytes, read at a step's end (CUDA only)."""

    reserved_peak_bytes: int | None = None
    """torch.cuda.max_memory_reserved since the last peak reset: the allocator's segments, fragmentation
    included, absolute."""
    device_used_bytes: int | None = None
    """total - free of torch.cuda.mem_get_info: everything on the device, the CUDA context, NCCL's
    buffers and other processes included."""


def device_readings(device: torch.device | str) -> DeviceReadings:
    """The reserved peak and the device's used bytes on CUDA (after the peak statistics were reset at
    the step's start); None for both elsewhere: the CPU has no such figures."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceReadings()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceReadings(reserved_peak_bytes=torch.cuda.max_memory_reserved(device), device_used_bytes=total - free)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


class _MallInfo(ctypes.Structure):
    # The pre-2.33 glibc struct: the same fields as C ints, wrong above 2 GiB in use.
    _fields_ = [(name, ctypes.c_int) for name, _ in _MallInfo2._fields_]


@functools.cache
def _mallinfo() -> Any:
    """The libc `mallinfo2` (or legacy `mallinfo`) function, resolved once."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: whichever malloc is really in use
    except (OSError, TypeError):  # Windows has no global symbol namespace
        libc = None
    for name, struct in (("mallinfo2", _MallInfo2), ("mallinfo", _MallInfo)):
        fn = getattr(libc, name, None)
        if fn is not None:
            fn.restype = struct
            fn.argtypes = []
            return fn
    raise RuntimeError(
        "CPU memory measurement needs glibc's mallinfo2() or mallinfo(), and this C library has "
        "neither (musl, macOS, Windows?); measure on Linux with glibc, or on a CUDA device")


def _cpu_in_use_bytes() -> int:
    info = _mallinfo()()
    return info.uordblks + info.hblkhd


def current_allocated_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes currently allocated for `device`: CUDA tensors, or the whole process's C heap on CPU.

    Called after every operator of a measured step: on CUDA it reads the allocator's nested
    statistics as they come from C++ (torch.cuda.memory_allocated flattens and sorts all of them
    into an OrderedDict first, on each call)."""
    device = torch.device(device)
    if device.type == "cuda":
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        return stats["allocated_bytes"]["all"]["current"] if stats else 0
    if device.type == "cpu":
        return _cpu_in_use_bytes()
    raise ValueError(f"device={str(device)!r}: memory measurement supports cpu and cuda only")


_POINT_TO_POINT = frozenset({"send", "recv_", "recv_any_source_"})
"""Not waited for: a rank may post a send before the matching receive (an exchange), and waiting
for it there would deadlock."""


def _wait_for_collective(func: Any, out: Any) -> None:
    """If `func` issued a collective (c10d's ops return its Work, functional collectives register
    it for their outputs), wait until it has completed, and with it the backend's threads' work."""
    if func.namespace == "c10d" and func._opname not in _POINT_TO_POINT:
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.ScriptObject):
                from torch.distributed.distributed_c10d import Work

                Work.unbox(x).wait()
    elif func.namespace == "_c10d_functional" and func._opname != "wait_tensor":
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(x)  # a no-op for a tensor whose work is done


class _CollectivesCompleted(TorchDispatchMode):
    # Runs every operator as given, tensor subclasses' too: returning NotImplemented for them breaks
    # DTensor's sharding propagation, which runs operators on FakeTensors through the mode stack.
    supports_higher_order_operators = True
    """Compiled blocks call higher-order operators (full checkpointing's run_and_save_rng_state): run
    them as any operator, their outputs tracked, their insides unseen."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # compiled code runs compiled (memory/traced/ledger.py)
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        _wait_for_collective(func, out)
        return out


def collectives_completed() -> TorchDispatchMode:
    """A dispatch mode that waits for every collective as it is issued (see the module docstring).
    Enter it before a mode that samples the allocator, so that it runs below it: the sample after
    a collective then comes after its completion."""
    return _CollectivesCompleted()


class _AllocatorSampler(TorchDispatchMode):
    """Samples the C heap after each aten operator (collectives once completed) and keeps the maximum."""

    def __init__(self, result: PeakMemory) -> None:
        super().__init__()
        self.result = result
        self.max_in_use = result.baseline_bytes

    supports_higher_order_operators = True
    """Compiled blocks call higher-order operators (full checkpointing's run_and_save_rng_state): run
    them as any operator, their outputs tracked, their insides unseen."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile'd code (compiled blocks, torchao's 8-bit optimizer update) runs compiled beneath
        the sampler, as one call: the buffers its kernels free before returning are workspace, unseen."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        _wait_for_collective(func, out)
        # Inputs are still referenced here, so this is the high-water mark around the operator.
        self.max_in_use = max(self.max_in_use, _cpu_in_use_bytes())
        self.result.num_samples += 1
        return out


@functools.cache
def _prime_dispatch_mode() -> None:
    """The first Python dispatch mode of a process imports ~800 modules (~22 MiB of C heap): do that
    before the baseline, or the first measurement would count it as part of the step."""
    with _AllocatorSampler(PeakMemory()):
        torch.ones(1).add_(1)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Keep the cycle collector from freeing older garbage (a stored traceback holding tensors, say)
    mid-step: that would drop in-use bytes below the baseline and hide part of the step's peak.
    Cycles the step itself creates then live to its end, which errs on the high side."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def measure_peak(device: torch.device | str) -> Iterator[PeakMemory]:
    """Measure the peak bytes allocated above the entry baseline while the block runs.

    Run the whole step (forward, backward, optimizer step) inside the block. On CUDA this resets
    the device's peak statistics (allocated and reserved), so measurements must not be nested there,
    and also records the reserved peak and the device's used bytes (device_readings).
    """
    device = torch.device(device)
    result = PeakMemory()
    with gc_paused():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            result.baseline_bytes = torch.cuda.memory_allocated(device)
            try:
                yield result
            finally:
                torch.cuda.synchronize(device)
                result.peak_bytes = torch.cuda.max_memory_allocated(device) - result.baseline_bytes
                readings = device_readings(device)
                result.reserved_peak_bytes, result.device_used_bytes = (readings.reserved_peak_bytes,
                                                                        readings.device_used_bytes)
            return
        _prime_dispatch_mode()
        result.baseline_bytes = current_allocated_bytes(device)
        sampler = _AllocatorSampler(result)
        try:
            with sampler:
                yield result
        finally:
            sampler.max_in_use = max(sampler.max_in_use, _cpu_in_use_bytes())
            result.peak_bytes = sampler.max_in_use - result.baseline_bytes
