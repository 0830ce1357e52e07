"""Memory of a real training step, measured at the allocator and attributed to components.

`MemoryMeter.measure(step)` wraps one training step it did not build: `step` is called once,
unchanged, while the meter's phase listener, attached to the step's own hooks (`step.listening`,
the moments of train/step.TrainStep.MOMENTS), marks the phases as in the traced estimator. Who
built the step and when to meter it is the caller's business (the trainer's loop,
train/trainer.py); the meter reports, for this rank:

- peak, phase_peaks, the components and the timeline: the tensors. `StorageLedger` (memory/traced/ledger.py),
  run on the real tensors, holds every live storage once with its bytes and its component (the
  same rules as the traced estimate), sampled after every aten operator; `peak` is the largest
  sum, with params, master_params, grads, optimizer, activations, logits and buffers at that
  sample. This is what the estimators model and what `trainfit report` compares them with.
- non_tensor: the allocator's peak above the tensors' peak. The allocator is read at every one of
  the ledger's samples (CPU: glibc's in-use bytes, every collective waited for first so that
  gloo's threads' scratch is gone, memory/measured/measure.py; CUDA: `memory_allocated` per operator and
  `max_memory_allocated` for the peak), as its growth since the step's start on top of the
  tensors alive then; what it holds beyond the tensors is what they do not explain. On CPU:
  math libraries' caches that grow during the step (oneDNN caches a primitive, with its weight
  reorders and scratchpad, per new matmul shape in 16 bits: dropless MoE experts see new row
  counts every step), autograd's graph objects and tensor headers, malloc's per-chunk overhead.
  On CUDA: the caching allocator's rounding of each block, library workspaces it hands out
  (cuBLAS's), temporaries an operator frees before it returns (`max_memory_allocated` sees
  them; the per-operator samples do not); its cache (reserved but unallocated) is in neither
  figure. Either device: tensors the ledger never saw created (what torch.compile'd blocks
  allocate inside, training.compile). No estimator models it; `peak + non_tensor` is the
  process's own peak of the step.
- reserved_peak and device_used (CUDA only; None on CPU): the caching allocator's reserved peak over
  the step (its statistics reset with the allocated peak) and the device's used bytes at the step's
  end (memory/measure.device_readings): what an out-of-memory error is decided on, the CUDA context
  and NCCL's buffers included in the latter.
- reserved_margin: what was in use before the step and is no tensor (math libraries' caches,
  oneDNN's bf16 kernels and workspaces on CPU, the first dispatch mode's imports, Python and
  autograd objects): in use at the step's start, above the meter's `memory_floor` (what was in use
  before the model was built), beyond the tensors alive then. `trainfit train` reports it beside
  the peak (Trainer.measured_step).
- two cross-checks: `forward_retained` (the tensor bytes the first micro-batch's forward + loss
  left alive: what analytic.forward_retained_bytes predicts) and `state_bytes` (the model states
  counted from the step's model and optimizer once every gradient is in, without the ledger,
  parallel/data_parallel.local_state_bytes).

The ledger finds parameters, gradients and optimizer states by itself; tensors held elsewhere
(DDP's gradient buckets, built at the first step and rebuilt at the second, held in C++) it
knows only if it saw them created. So one meter serves a step for its whole life and also
*watches* steps (`MemoryMeter.watch`: the ledger without allocator sampling): the trainer's loop
watches its first step and measures its second; a tensor created by an unwatched step counts in
reserved_margin, not in the peak.

Under torchrun every rank measures itself; nothing is gathered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.measured import measure
from trainfit.memory.traced.ledger import StorageLedger, TimelinePoint, phase_listener, unsharded_component
from trainfit.parallel.data_parallel import local_state_bytes
from trainfit.parallel.layout import Layout
from trainfit.precision import PrecisionPolicy

CUDA_HISTORY = MappingProxyType({"max_entries": 100_000, "stacks": "python"})
"""torch.cuda.memory._record_memory_history's arguments: the last 100,000 allocations and frees, each
with its Python stack only; C++ stacks (torch's default, stacks="all") make the snapshot's dump
symbolize every frame, far slower than the step it records."""


@dataclass
class Measurement:
    breakdown: MemoryBreakdown
    """Components at the tensors' peak, phase, phase peaks; non_tensor and reserved_margin apart."""
    timeline: list[TimelinePoint]
    """Tensor bytes in use (as `peak` counts them) after every operator of the step."""
    peak_module: str
    forward_retained: int
    """Tensor bytes alive after the first micro-batch's forward + loss, minus before it."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """The step's own count of params / grads / optimizer bytes after backward."""
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the breakdown's fields, the cross-checks, the timeline as lists."""
        out = dataclasses.asdict(self)
        out["timeline"] = [list(point) for point in self.timeline]
        return out


class _Probe:
    """Reads the allocator at every sample of the ledger and keeps the largest reading: the step's
    allocator growth (in use now - in use at the step's start) on top of the tensor bytes alive at
    the start (`base`, counted exactly by the ledger), so that it compares with the ledger's totals."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0
        self.base = 0
        self.peak = -1

    def begin(self, ledger: StorageLedger) -> None:
        self.start = measure.current_allocated_bytes(self.device)
        self.base = ledger.total

    def read(self) -> int:
        return measure.current_allocated_bytes(self.device) - self.start + self.base

    def __call__(self, op: int) -> None:
        self.peak = max(self.peak, self.read())


@contextlib.contextmanager
def cuda_history(path: Path | None) -> Iterator[None]:
    """CUDA only: record allocator history and dump a snapshot (pytorch.org/memory_viz) to `path`."""
    if path is None:
        yield
        return
    torch.cuda.memory._record_memory_history(**CUDA_HISTORY)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


Stats = TypeVar("Stats", covariant=True)


class MeteredStep(Protocol[Stats]):
    """What the meter wraps: one training step, run by calling it, with its listener hooks.
    `listening(listener)` calls `listener(moment)` within the block at each moment of the step:
    "forward" (a micro-batch's forward and loss start), "backward" (its backward starts),
    "optimizer" (every backward done; gradient reduction, unscaling, clipping start), "update" (the
    optimizer is about to step). train/step.TrainStep is one; `model`, `optimizer` and `policy`
    are read to tell the model states apart."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    policy: PrecisionPolicy

    def listening(self, listener: Callable[[str], None]) -> AbstractContextManager[None]: ...

    def __call__(self) -> Stats: ...


T = TypeVar("T")


class MemoryMeter:
    """One StorageLedger, kept for the life of the step it meters and entered only for the steps it
    watches or measures (see the module docstring); it holds no reference to the step between them.
    `layout`: the step's (how FSDP's unsharded parameters count, whether backward is split); None
    for a step without one (no sharding, no pipeline). `rank`, `world_size`: recorded in the
    Measurement. `memory_floor`: bytes in use before the step's model was built, the bottom of
    reserved_margin."""

    def __init__(self, device: torch.device, layout: Layout | None = None, *, rank: int = 0, world_size: int = 1,
                 memory_floor: int = 0) -> None:
        self.device = device
        self.split_backward = layout is not None and layout.splits_backward
        self.rank, self.world_size, self.memory_floor = rank, world_size, memory_floor
        self.ledger = StorageLedger(fake=False, device_type=device.type,
                                    unsharded_component=unsharded_component(layout) if layout else "buffers")

    @contextlib.contextmanager
    def _watching(self, step: MeteredStep[Any],
                  on_forward: Callable[[str], None] | None = None) -> Iterator[StorageLedger]:
        ledger = self.ledger
        with ledger, step.listening(phase_listener(ledger, step, on_forward)):
            ledger.watch_model(step.model, split_backward=self.split_backward)
            ledger.grad_hooks(list(step.model.parameters()))
            try:
                yield ledger
            finally:
                ledger.in_loss = False

    def watch(self, step: MeteredStep[T]) -> T:
        """`step()` with the ledger recording the tensors it creates (~15% slower)."""
        with self._watching(step):
            return step()

    def measure(self, step: MeteredStep[T], *, cuda_snapshot: str | Path | None = None) -> tuple[T, Measurement]:
        """`step()` measured on this rank: what the step returned and its measurement.
        `cuda_snapshot`: on CUDA, also write the allocator's memory snapshot (pytorch.org/memory_viz)."""
        device = self.device
        serial = contextlib.nullcontext() if device.type == "cuda" else measure.collectives_completed()
        if device.type != "cuda":
            measure._prime_dispatch_mode()
        probe = _Probe(device)
        marks: dict[str, int] = {}

        def on_forward(moment: str) -> None:
            if self.ledger.recording:
                marks.setdefault(moment, self.ledger.total)

        state_bytes: dict[str, int] = {}

        def count_states(moment: str) -> None:
            if moment == "update":  # every gradient in, unscaled and clipped; the optimizer not yet stepped
                state_bytes.update(local_state_bytes(step.model, step.optimizer))

        self.ledger.on_sample = probe
        try:
            # CPU: below the ledger, so that it samples after a collective has completed (measure.py).
            with serial, self._watching(step, on_forward) as ledger, step.listening(count_states):
                stats, readings = _sampled_step(step, device, ledger, probe, cuda_snapshot)
                ledger.classify(step.model, step.optimizer, step.policy)
        finally:
            self.ledger.recording, self.ledger.on_sample = False, None
        tensors = self.ledger.breakdown()
        breakdown = dataclasses.replace(
            tensors, non_tensor=max(0, probe.peak - tensors.peak),  # < 0: an unseen older tensor was freed
            reserved_margin=max(0, probe.start - self.memory_floor - probe.base),
            reserved_peak=readings.reserved_peak_bytes, device_used=readings.device_used_bytes)
        timeline, self.ledger.timeline = self.ledger.timeline, []  # not kept alive with the meter
        return stats, Measurement(breakdown=breakdown, timeline=timeline, peak_module=self.ledger.peak_module,
                                  forward_retained=marks["end"] - marks["start"], state_bytes=state_bytes,
                                  rank=self.rank, world_size=self.world_size, device=str(device))


def _sampled_step(step: MeteredStep[T], device: torch.device, ledger: StorageLedger, probe: _Probe,
                  cuda_snapshot: str | Path | None) -> tuple[T, measure.DeviceReadings]:
    """One step with the probe reading the allocator from a clean start (garbage collected, then
    the collector paused; model states classified; CUDA's peak statistics reset), and the device's
    readings at its end (None on CPU)."""
    cuda = device.type == "cuda"
    gc.collect()
    with measure.gc_paused(), cuda_history(Path(cuda_snapshot) if cuda and cuda_snapshot else None):
        ledger.classify(step.model, step.optimizer, step.policy, others="buffers")
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        probe.begin(ledger)
        ledger.reset_peak()
        stats = step()
        if cuda:
            torch.cuda.synchronize(device)
            probe.peak = max(probe.peak, torch.cuda.max_memory_allocated(device) - probe.start + probe.base)
        readings = measure.device_readings(device)
    return stats, readings
