"""Weights held as torchao's NF4Tensor (QLoRA's base, built by peft/nf4.py): telling them apart, and
setting one from the whole weight in full precision, as initialization and HF weight loading do.

Every rank quantizes the whole weight alike and keeps its rows: the double quantization's mean is
the whole tensor's, so a shard quantized alone would differ from its slice of the whole.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
"""Where torchao keeps NF4Tensor (imported by path: torchao's package root imports much more)."""
NF4_DTYPE = torch.bfloat16
"""What NF4 weights are quantized from and dequantize to (peft/spec.py's NF4_DTYPE_BYTES)."""


def nf4_module() -> ModuleType:
    """torchao's NF4 module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module(NF4_MODULE)
    except ImportError as err:
        raise ImportError(f"peft.method='qlora' needs torchao's NF4 tensor ({NF4_MODULE}): "
                          "pip install torchao") from err


def is_nf4(param: torch.Tensor) -> bool:
    """Whether a parameter (or a DTensor's local part) is held as NF4 (no torchao import)."""
    local = param._local_tensor if isinstance(param, DTensor) else param
    return type(local).__name__ == "NF4Tensor"


@torch.no_grad()
def assign_nf4_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Quantize `full`, the whole weight in full precision, and keep this rank's rows of it in
    `param` (an NF4 parameter, or a DTensor of NF4 row shards). A fake tensor holds no values."""
    # The DTensor's own local tensor, the object FSDP2 all-gathers from (to_local() returns an alias)
    local = param._local_tensor if isinstance(param, DTensor) else param
    if isinstance(local.quantized_data, FakeTensor):
        local.scaler_mean = torch.zeros((), dtype=NF4_DTYPE, device=local.quantized_data.device)
        local.nf4 = torch.zeros(local.nf4.shape, dtype=NF4_DTYPE, device=local.quantized_data.device)
        return
    quantized = nf4_module().to_nf4(full.to(device=local.quantized_data.device, dtype=NF4_DTYPE).contiguous(),
                                    local.block_size, local.scaler_block_size)
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        quantized = torch.split(quantized, shape[0])[offset[0] // shape[0]]
    local.copy_(quantized)
    # The mean and the codebook are not shards: to_empty() leaves them where they were built (the
    # meta device), and copy_ cannot move them.
    local.scaler_mean, local.nf4 = quantized.scaler_mean.clone(), quantized.nf4.clone()
