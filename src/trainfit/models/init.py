"""Layout-independent initialization: every parameter's values are a function of the run's seed
and the parameter's name only, and each rank computes just the part it holds.

A parameter is cut into blocks of whole rows (dim 0); block b of parameter `name` is drawn from a
generator seeded by hash(seed, name, b), on the CPU. A rank holding rows [r0, r1) and columns
[c0, c1) (an FSDP shard, a tensor-parallel slice, or the whole tensor) draws only the blocks that
overlap its rows, keeps its columns, and copies them to its device. So one process, DDP, ZeRO-3,
HSDP or tensor parallelism start from bit-identical weights, and no rank ever allocates more than
its share plus one block.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

INIT_STD = 0.02
"""Standard deviation of weights (GPT-2, Llama reference implementations)."""
RESIDUAL_SUFFIXES = ("wo.weight", "w2.weight", "experts.w2")
"""Projections that write into the residual stream: std scaled by 1/sqrt(2 x num_layers)."""
BLOCK_ELEMENTS = 1 << 20
"""Elements drawn per generator (whole rows; at least one row): bounds the transient host memory
of initialization to 4 MiB per parameter, whatever the parameter's size."""
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""Module names that wrappers (activation checkpointing, torch.compile, FSDP1) insert into
parameter names: removed, so that a parameter's name, hence its values, does not depend on them."""


def canonical_name(name: str) -> str:
    """The parameter's name in the plain model (what a checkpoint and the init seed use)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit seed from (run seed, parameter name, block index), stable across processes and
    Python versions (unlike hash())."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _local_region(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of what this rank holds of `param`."""
    if isinstance(param, DTensor):
        return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def fill_normal_(param: torch.Tensor, *, std: float, seed: int, name: str) -> None:
    """Fill this rank's part of `param` with N(0, std²) values that depend on (seed, name) only.
    A fake tensor (the traced estimator) holds no values: nothing is drawn, and its region is not
    computed (a strided shard's is a Python loop over fake index tensors)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0 or isinstance(local, FakeTensor):
        return
    shape, offset = _local_region(param)
    full = tuple(param.shape)
    row_numel = math.prod(full[1:])
    rows_per_block = max(1, BLOCK_ELEMENTS // max(1, row_numel))
    r0, r1 = offset[0], offset[0] + shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:], strict=True))
    generator = torch.Generator(device="cpu")
    for block in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1):
        b0 = block * rows_per_block
        b1 = min(full[0], b0 + rows_per_block)
        generator.manual_seed(block_seed(seed, name, block))
        values = torch.empty((b1 - b0, *full[1:]), dtype=torch.float32).normal_(0.0, std, generator=generator)
        lo, hi = max(r0, b0), min(r1, b1)
        local[lo - r0:hi - r0].copy_(values[(slice(lo - b0, hi - b0), *cols)])


@torch.no_grad()
def fill_constant_(param: torch.Tensor, value: float) -> None:
    (param.to_local() if isinstance(param, DTensor) else param).fill_(value)


def init_parameters(model: nn.Module, *, seed: int, num_layers: int) -> None:
    """Re-tie shared embeddings (to_empty() unties them), then N(0, 0.02) for weights, scaled by
    1/sqrt(2 x num_layers) on residual output projections (GPT-2's scheme); ones for norm gains (zeros
    for Gemma's, which add one), zeros for biases. Each value depends on (seed, parameter name) only; see
    the module docstring."""
    if model.cfg.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight
    from trainfit.models.nf4 import assign_nf4_, is_nf4

    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        if name.endswith(".lora_a"):  # PEFT's kaiming_uniform_(a=sqrt(5)) variance, 1 / (3 in)
            fill_normal_(param, std=1 / math.sqrt(3 * param.shape[-1]), seed=seed, name=name)
        elif name.endswith(".lora_b"):  # zero: the adapted model starts as the base
            fill_constant_(param, 0.0)
        elif name.endswith(".lora_magnitude"):
            continue  # init_magnitudes, from the weight
        elif name.endswith("bias"):
            fill_constant_(param, 0.0)
        elif name.rsplit(".", 2)[-2].endswith("norm"):  # a gain: 1, Gemma's (1 + w) norms' w 0
            fill_constant_(param, 0.0 if model.cfg.norm_offset else 1.0)
        else:
            std = residual_std if name.endswith(RESIDUAL_SUFFIXES) else INIT_STD
            if is_nf4(param):  # QLoRA's base: the same values as LoRA's, quantized whole (peft/nf4.py)
                full = torch.empty(param.shape, dtype=torch.float32)
                fill_normal_(full, std=std, seed=seed, name=name)
                assign_nf4_(param, full)
            else:
                fill_normal_(param, std=std, seed=seed, name=name)
    init_magnitudes(model)


@torch.no_grad()
def init_magnitudes(model: nn.Module) -> None:
    """DoRA's magnitude (peft/adapters.py) starts as its linear's weight row norms, so with B = 0 the
    adapted model is the base: after initialization, and again once base weights are loaded. Each
    rank's rows of the magnitude are its rows of the weight (both split along dim 0, or both whole)."""
    for module in model.modules():
        magnitude = getattr(module, "lora_magnitude", None)
        if magnitude is None:
            continue
        weight = module.weight
        local_w = weight.to_local() if isinstance(weight, DTensor) else weight
        local_m = magnitude.to_local() if isinstance(magnitude, DTensor) else magnitude
        if local_m.numel() and not isinstance(local_m, FakeTensor):
            local_m.copy_(torch.linalg.vector_norm(local_w.float(), dim=1).to(local_m.dtype))
