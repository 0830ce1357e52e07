"""The one vocabulary of per-rank training memory, shared by the analytic estimator, the traced
estimator and measurement, so any two can be compared component by component. Torch-free.

Components (bytes, ints):
- params: compute copies of the parameters held by the rank (sharded ones counted as their shard)
- master_params: fp32 copies kept beside low-precision compute params (0 when params are the master)
- grads: gradients held at the peak
- optimizer: optimizer states
- activations: tensors saved for backward at the peak moment
- logits: logits, loss and their gradients
- buffers: communication and temporary buffers (all-gather / reduce-scatter / buckets / prefetch /
  recompute / optimizer-step temporaries)
- peak: the largest sum of the tensors over the step's phases (forward, backward, optimizer step)
- reserved_margin: what the device holds outside the tensors' peak, shown apart, never inside another
  figure; estimates on a GPU sum it from `margin_terms` (the CUDA context, allocator fragmentation,
  NCCL's communicator buffers: memory/margin.reserved_margin_terms)
- non_tensor: measured only: what the allocator held at the step's peak beyond the tensors (library
  caches such as oneDNN's per-shape primitives on CPU, allocator overhead), shown apart; no estimator
  models it (0 in estimates)
- reserved_peak, device_used: measured on CUDA only (None elsewhere): the caching allocator's
  reserved peak and the device's used bytes at the step's end (memory/measured/measure.device_readings),
  absolute figures to hold against the device's memory, not components; the traced estimate on a
  GPU predicts reserved_peak by replaying the allocator's rules (memory/traced/caching_allocator.py)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

COMPONENTS = ("params", "master_params", "grads", "optimizer", "activations", "logits", "buffers")
PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int = 0
    master_params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    buffers: int = 0
    peak: int = 0
    """Tensor bytes in use at the step's peak; the components above are their values at that moment."""
    peak_phase: str = ""
    """forward | backward | optimizer: where the peak lands."""
    reserved_margin: int = 0
    margin_terms: dict[str, int] = field(default_factory=dict)
    """Estimates on a GPU: reserved_margin's terms by name (cuda_context, allocator_fragmentation,
    comm_buffers), summing to it; empty on the CPU and in measurements, whose margin is one figure."""
    non_tensor: int = 0
    """Measured steps: the allocator's peak above `peak` (the tensors'), so the process's own peak is
    `peak + non_tensor`; memory/measured/attribution.py says what it holds. Estimates leave it 0."""
    reserved_peak: int | None = None
    """Measured on CUDA: torch.cuda.max_memory_reserved over the step (the allocator's segments, its
    fragmentation included); the traced estimate on a GPU: the same, its allocations replayed through the
    allocator's rules. None in the analytic estimate and on CPU, which has no such figure."""
    device_used: int | None = None
    """Measured on CUDA: the device's used bytes at the step's end (total - free, cudaMemGetInfo): the
    CUDA context, NCCL's buffers and other processes included. None in estimates and on CPU."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """The largest in-use bytes of each phase (forward, backward, optimizer)."""

    @property
    def model_states(self) -> int:
        return self.params + self.master_params + self.grads + self.optimizer

    def components(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COMPONENTS}

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        """The n largest components, largest first."""
        return sorted(self.components().items(), key=lambda kv: kv[1], reverse=True)[:n]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
