"""The attention kernel of a run: training.attention_backend applied to every attention, and a probe
that finds which of torch's scaled_dot_product_attention kernels the run's attention actually runs.

torch picks the kernel at each call (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp on CPU:
its flash kernel for every dense input of a float dtype, else math; cuda/sdp_utils.cpp on CUDA: in
priority order cuDNN (on sm90/sm100 with a recent cuDNN), flash (fp16/bf16 only, no explicit mask,
head dim <= 256), memory-efficient (fp32 too, masks allowed, head dim a multiple of 4 or 8), math),
so the choice is made where SDPA is called: models/common.WholeSequence.kernel(). The probe runs one
tiny SDPA of the run's form (device, compute dtype, a rank's heads and kv heads, head dim, causal or
with context parallelism's explicit mask) forward and backward under those backends, and records
the aten op that ran: a kernel that cannot run the run's attention fails there, before the model
trains, as a ConfigError.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from trainfit.config import ConfigError, field_error

BACKENDS: dict[str, list[SDPBackend] | None] = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "math": [SDPBackend.MATH],
}
"""training.attention_backend -> the backends SDPA may use (None: torch chooses)."""

FUSED_KERNELS = {
    "aten._scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten._scaled_dot_product_flash_attention": "flash",
    "aten._scaled_dot_product_efficient_attention": "memory-efficient",
    "aten._scaled_dot_product_cudnn_attention": "cuDNN",
    "aten._scaled_dot_product_fused_attention_overrideable": "fused (the device's own)",
}
"""The fused kernels' aten ops (what the dispatcher sees below F.scaled_dot_product_attention) and
their names. Anything else is the math path, which decomposes into bmm and _safe_softmax."""
MATH_OP = "aten._safe_softmax"


@dataclass(frozen=True)
class AttentionKernel:
    """The kernel a run's attention uses."""

    backend: str
    """training.attention_backend."""
    op: str
    """The aten op that ran (the fused kernel's, or MATH_OP for the math decomposition)."""
    name: str
    """flash (CPU) | flash | memory-efficient | cuDNN | math | ..."""

    @property
    def fused(self) -> bool:
        return self.op in FUSED_KERNELS

    def note(self) -> str:
        chosen = "chosen by torch (training.attention_backend=auto)" if self.backend == "auto" else \
            f"training.attention_backend={self.backend}"
        return f"attention kernel: {self.name} ({self.op}), {chosen}"


class _SeenOps(TorchDispatchMode):
    """Records the name of every aten op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def probe_attention_kernel(backend: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int, *, masked: bool = False) -> AttentionKernel:
    """Run one SDPA of the run's form (batch 1, 16 queries) forward and backward under `backend`;
    return the kernel that ran, or raise a ConfigError naming why torch could not run it.
    `masked`: context parallelism's form, an explicit additive mask of [queries, keys] with more
    keys than queries; else causal, square (is_causal=True)."""
    queries, keys = (8, 16) if masked else (16, 16)

    def make(num_heads: int, length: int, dim: int) -> torch.Tensor:
        return torch.randn(1, num_heads, length, dim, device=device).to(dtype).requires_grad_()

    q, k, v = make(heads, queries, head_dim), make(kv_heads, keys, head_dim), make(kv_heads, keys, head_dim)
    mask = None
    if masked:  # lower-right-aligned causal, as ContextParallel._mask
        hidden = torch.arange(keys, device=device)[None, :] > torch.arange(queries, device=device)[:, None] + (
            keys - queries)
        mask = torch.zeros(queries, keys, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    seen = _SeenOps()
    backends = BACKENDS[backend]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sdpa_kernel(backends) if backends is not None else contextlib.nullcontext(), seen:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                                     enable_gqa=heads != kv_heads)
                out.sum().backward()
    except RuntimeError as err:
        reasons = "; ".join(str(w.message).strip() for w in caught) or str(err).splitlines()[0].rstrip(".")
        if device.type == "cpu":
            reasons += " (on CPU torch has only its flash kernel and math)"
        form = (f"{dtype} on {device.type}, {heads} heads, {kv_heads} kv heads, head dim {head_dim}, "
                + ("an explicit mask (context parallelism, a sliding window)" if masked else "causal"))
        raise field_error("training.attention_backend", backend,
                          f"torch cannot run this kernel for the run's attention ({form}): {reasons}. Choose "
                          "auto (torch picks a kernel that runs) or math (runs everywhere)") from err
    fused = next((op for op in seen.ops if op in FUSED_KERNELS), None)
    if fused is None and MATH_OP not in seen.ops:
        raise ConfigError(f"training.attention_backend={backend!r}: the attention ran none of the known kernels "
                          f"({', '.join(dict.fromkeys(seen.ops))})")
    return AttentionKernel(backend, fused or MATH_OP, FUSED_KERNELS[fused] if fused else "math")


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Make every attention of `model` (its sequence layouts: models/common.WholeSequence, or context
    parallelism's) call SDPA under `backend`."""
    for module in model.modules():
        sequence = getattr(module, "sequence", None)
        if sequence is not None:
            sequence.backends = BACKENDS[backend]
