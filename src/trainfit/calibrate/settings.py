"""What `trainfit calibrate` measures on each device type (shapes, message sizes, time limits), and
what one shape's tensors take, so that a GPU skips what its free memory cannot hold. Torch-free.

A CPU and a GPU need different work: the CPU's shapes would time a GPU's kernel launches rather
than its rates, and a GPU's would take a CPU minutes a call. So each device type measures what its
training runs: on a GPU, transformer GEMMs of 4096-8192 tokens and dims, causal attention over
4096-8192 tokens at head dim 128, collectives up to 1 GiB (a large model's gradient buckets and
FSDP units); on a CPU, the sizes its small models train at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    shapes: tuple[tuple[int, int], ...]
    """(tokens, dim): each measured as tokens x dim x dim and tokens x dim x 4 dim."""
    attention_shapes: tuple[tuple[int, int, int, int], ...]
    """(batch, heads, sequence length, head dim) of causal attention."""
    max_call_s: float
    """A shape whose one call would take longer than this at its dtype's rate so far is skipped."""
    batch_s: float
    """How long each timed batch of back-to-back calls lasts, about."""
    repeats: int
    """Timed batches per figure; the figure is their median."""
    memory_bytes: int
    """Size of each tensor of the copy and add; well beyond the caches."""
    message_bytes: tuple[int, ...]
    """Collective message sizes (fp32), smallest first."""
    optimizer_params: tuple[int, ...]


DEFAULT = Settings(shapes=((512, 128), (2048, 256), (2048, 512), (4096, 768)),
                   attention_shapes=((8, 8, 256, 32), (4, 8, 512, 64), (2, 16, 1024, 64)), max_call_s=0.5, batch_s=0.1,
                   repeats=5, memory_bytes=256 * 2**20, message_bytes=tuple(4**i * 2**12 for i in range(7)),
                   optimizer_params=(2**20, 2**22, 2**24))
"""A CPU's calibration."""
QUICK = Settings(shapes=((512, 128), (2048, 256)), attention_shapes=((2, 4, 128, 32),), max_call_s=0.05,
                 batch_s=0.02, repeats=2,
                 memory_bytes=64 * 2**20, message_bytes=(2**12, 2**16, 2**20, 2**22), optimizer_params=(2**18, 2**20))
"""A CPU's calibration with --quick."""
CUDA_DEFAULT = Settings(shapes=((4096, 4096), (8192, 4096), (8192, 8192)),
                        attention_shapes=((4, 32, 1024, 128), (1, 32, 4096, 128), (1, 32, 8192, 128)),
                        max_call_s=0.5, batch_s=0.05, repeats=5, memory_bytes=2**30,
                        message_bytes=tuple(4**i * 2**12 for i in range(10)),  # 4 KiB to 1 GiB
                        optimizer_params=(2**22, 2**24, 2**26))
"""A GPU's calibration. Its largest GEMM, 8192 x 8192 x 32768, is a large model's feed-forward; its
batches are shorter than a CPU's, as a GPU's kernels take milliseconds and vary less."""
CUDA_QUICK = Settings(shapes=((4096, 4096),), attention_shapes=((1, 32, 4096, 128),), max_call_s=0.2, batch_s=0.02,
                      repeats=3, memory_bytes=2**28, message_bytes=(2**12, 2**20, 2**24, 2**28),
                      optimizer_params=(2**22, 2**24))
"""A GPU's calibration with --quick."""


def settings_for(device_type: str, *, quick: bool) -> Settings:
    """The work a calibration on `device_type` (cuda or cpu) measures."""
    if device_type == "cuda":
        return CUDA_QUICK if quick else CUDA_DEFAULT
    return QUICK if quick else DEFAULT


# ---------------------------------------------------------------- what fits a GPU

FREE_FRACTION = 0.8
"""Of a device's free memory, the most one shape's tensors may take: the rest is for the caching
allocator's rounding, cuBLAS's workspaces and NCCL's buffers."""


def fits(nbytes: int, free_bytes: int | None) -> bool:
    """Whether work needing `nbytes` fits a device with `free_bytes` free (None: not checked, a CPU's)."""
    return free_bytes is None or nbytes <= FREE_FRACTION * free_bytes


def matmul_bytes(m: int, k: int, n: int, itemsize: int) -> int:
    """A GEMM's operands and output, twice over: its backward holds the input, the weight, the
    output's gradient and one product at once."""
    return 2 * (m * k + k * n + m * n) * itemsize


def attention_bytes(shape: tuple[int, int, int, int], itemsize: int) -> int:
    """Forward and backward's (batch, heads, seq, head dim) tensors: query, key, value, their
    gradients, the output and its gradient (the fused kernels keep no seq x seq scores)."""
    return 8 * math.prod(shape) * itemsize


def message_rank_bytes(nbytes: int) -> int:
    """What one rank holds for a collective of `nbytes`: a kind's buffers (the full message, its share,
    all-to-all's output) while the previous kind's are not yet freed."""
    return 4 * nbytes
