"""The reserved margin beside the tensors' peak on a GPU: the CUDA context, the caching allocator's
fragmentation and NCCL's communicator buffers (memory/closed_form/comm_buffers.py). Assumptions, named once, that the
analytic and traced estimates both add (memory/breakdown.py shows them apart from the peak)."""

from __future__ import annotations

from trainfit.config import HardwareConfig

MIB = 1024**2


CUDA_CONTEXT_BYTES = 500 * MIB
"""CUDA context and cuBLAS/cuDNN workspaces outside the caching allocator: 300-600 MiB on
A100/H100 with torch 2.x (nvidia-smi minus torch.cuda.memory_reserved). An assumption."""


ALLOCATOR_FRAGMENTATION = 0.08
"""Reserved-but-unallocated share of the CUDA caching allocator at the peak: 5-10% in steady-state
training memory snapshots. An assumption; 0 on CPU, where glibc's in-use bytes are the truth."""


def reserved_margin_terms(hardware: HardwareConfig, peak: int, comm_buffers: int) -> dict[str, int]:
    """The reserved margin's terms on a GPU, bytes: the CUDA context, the caching allocator's
    fragmentation at `peak`, NCCL's communicator buffers (memory/closed_form/comm_buffers.comm_buffer_bytes).
    None on the CPU ({})."""
    if hardware.gpu == "cpu":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_fragmentation": int(ALLOCATOR_FRAGMENTATION * peak),
            "comm_buffers": comm_buffers}
