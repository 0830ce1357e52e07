"""QLoRA's frozen base: the block linears peft/spec.py names held as torchao's NF4Tensor (4-bit
NormalFloat with double quantization, Dettmers et al. 2023), which every matmul dequantizes to bf16
(its F.linear is torchao's linear_nf4: no weight gradient, the input's from the dequantized weight).

The NF4 weights are created empty on the meta device, after the precision policy has cast the
model (a later cast would dequantize them) and before parallelization, so FSDP2 shards them as NF4
(NF4Tensor implements its all-gather extension: the shards travel and are gathered as NF4) and
to_empty() allocates each rank's NF4 shard. Initialization and HF weight loading set their values
(models/nf4.py's assign_nf4_: the whole weight quantized, each rank keeping its rows).
"""

from __future__ import annotations

import torch
from torch import nn

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.block_spec import block_linears
from trainfit.models.nf4 import NF4_DTYPE, is_nf4, nf4_module
from trainfit.peft import spec


def empty_nf4(shape: tuple[int, int], device: torch.device | str) -> torch.Tensor:
    """An NF4 tensor of `shape` with unset contents (its inner tensors empty): what the meta-device
    model holds until to_empty() and assign_nf4_."""
    nf4 = nf4_module()
    numel = shape[0] * shape[1]
    blocks = numel // spec.NF4_BLOCK
    meta = nf4.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, NF4_DTYPE, torch.device(device), False)
    return nf4.NF4Tensor(meta, spec.NF4_BLOCK, blocks, spec.NF4_SCALER_BLOCK,
                         torch.empty(blocks, dtype=torch.int8, device=device),
                         torch.empty(blocks // spec.NF4_SCALER_BLOCK, dtype=NF4_DTYPE, device=device),
                         torch.empty((), dtype=NF4_DTYPE, device=device),
                         torch.empty(numel // 2, dtype=torch.uint8, device=device),
                         torch.empty(spec.NF4_CODEBOOK, dtype=NF4_DTYPE, device=device))


def quantize_base(model: nn.Module, cfg: ModelConfig, peft: PeftConfig, quantized: tuple[str, ...]) -> None:
    """Replace the weight of each block linear named in `quantized` (the Layout's
    Adaptation.quantized) with a frozen, empty NF4 one, on the meta device, in place."""
    if peft.method != "qlora":
        return
    paths = [linear.path for linear in block_linears(cfg) if linear.name in quantized]
    for block in model.layers:
        for path in paths:
            linear: nn.Linear = block.get_submodule(path)
            weight = linear.weight
            linear.weight = nn.Parameter(empty_nf4(tuple(weight.shape), weight.device), requires_grad=False)


@torch.no_grad()
def dequantize_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every NF4 weight of a plain (unparallelized) model with its dequantization (bf16, held
    in `dtype`, the model's), in place: the weights a QLoRA run trained its adapters on, as full HF
    weights hold them."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and is_nf4(weight):
            module.weight = nn.Parameter(weight.get_original_weight().to(dtype), requires_grad=False)
