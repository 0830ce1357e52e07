"""fp8-mixed's float8 linears (torchao 0.18's float8 training), kept apart from precision.py so that
only fp8 runs import torchao (train/parallelize.py and the trainer import this module lazily).

What changes in a converted nn.Linear (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args):
the forward casts the input and the weight to fp8 (e4m3) with a dynamic scale (tensorwise: one
fp32 per tensor; rowwise: one per row of the input and per column of the weight, powers of 2) and
multiplies them with torch._scaled_mm; the backward casts the output gradient (e5m2 tensorwise,
e4m3 rowwise) and the weight again for the input gradient, the output gradient and the input
again for the weight gradient. Autograd saves the high-precision input and weight, never their fp8
casts: every fp8 tensor is transient. With FSDP2 float8 all-gather the weight arrives in fp8 already
(torchao/float8/fsdp_utils.py, WeightWithDynamicFloat8CastTensor) and that fp8 copy is what is saved.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_linear import Float8Linear

from trainfit.perf.fp8_casts import DIM_MULTIPLE
from trainfit.precision import PrecisionPolicy

KEPT_BF16 = frozenset({"output"})
"""Linears left in bf16 by name: the output projection (torchtitan's float8 converter filters it out
too): its error would reach the logits and the loss directly."""


class Float8LinearAnyDevice(Float8Linear):
    """torchao's Float8Linear, its input cast to the autocast dtype of the input's own device.

    torchao 0.18 casts the input only under CUDA autocast (torch.get_autocast_gpu_dtype); under CPU
    autocast it would cast (and save) the fp32 input instead. With this, one process and DDP save a
    bf16 input per linear on both devices, as bf16-mixed's autocast does."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        return super().forward(input)


def skip_reason(name: str, module: nn.Module) -> str | None:
    """Why the nn.Linear `module` (qualified name `name`) stays in bf16 under fp8-mixed, or None."""
    if name.rsplit(".", 1)[-1] in KEPT_BF16:
        return "the output projection, kept in bf16 by design"
    if not isinstance(module, nn.Linear):
        return "not an nn.Linear"
    k, n = module.in_features, module.out_features
    if k % DIM_MULTIPLE or n % DIM_MULTIPLE:
        return f"{k} -> {n} features: fp8 matmuls need multiples of {DIM_MULTIPLE}"
    return None


def pads_inner_dim(tokens_per_matmul: int) -> bool:
    """Must the weight-gradient GEMMs pad their inner dimension? grad_weight = grad_output^T @ input
    sums over a micro-batch's tokens, and CUDA's torch._scaled_mm takes only inner dimensions that
    are multiples of DIM_MULTIPLE (the CPU kernel takes any: a CPU run would not notice). The
    forward's and grad_input's inner dimensions are features, which skip_reason already checks."""
    return tokens_per_matmul % DIM_MULTIPLE != 0


def linear_config(policy: PrecisionPolicy, tokens_per_matmul: int = DIM_MULTIPLE) -> Float8LinearConfig:
    """torchao's config for the policy's recipe (tensorwise | rowwise), with FSDP2 float8 all-gather;
    padding the GEMMs' inner dimension with zeros (torchao's pad_inner_dim) only where a
    micro-batch's `tokens_per_matmul` needs it: the pad copies each operand."""
    if policy.fp8_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(policy.fp8_scaling or "tensorwise")
    return dataclasses.replace(config, pad_inner_dim=pads_inner_dim(tokens_per_matmul))


def convert_to_float8(model: nn.Module, policy: PrecisionPolicy, tokens_per_matmul: int = DIM_MULTIPLE) -> None:
    """Swap in place every nn.Linear of `model` that skip_reason allows for a float8 one (on the
    meta device, before tensor and data parallelism: torchtitan's order). `tokens_per_matmul`: the
    rows of one linear's input in a training step (a micro-batch's tokens on this rank)."""
    convert_to_float8_training(model, config=linear_config(policy, tokens_per_matmul),
                               module_filter_fn=lambda module, name: skip_reason(name, module) is None)
    for module in model.modules():
        if type(module) is Float8Linear:
            module.__class__ = Float8LinearAnyDevice  # same state, device-aware forward


def float8_notes(model: nn.Module) -> list[str]:
    """One line for the training log: how many linears compute in float8, and which stay in bf16 and why."""
    converted = sum(isinstance(m, Float8Linear) for m in model.modules())
    kept = [f"{name} ({skip_reason(name, m)})" for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, Float8Linear)]
    notes = [f"fp8-mixed: {converted} linear(s) compute in float8" + (f"; kept in bf16: {', '.join(kept)}" if kept
                                                                       else "")]
    if any(isinstance(m, Float8Linear) and m.config.pad_inner_dim for m in model.modules()):
        notes.append(f"fp8-mixed: a micro-batch's tokens are not a multiple of {DIM_MULTIPLE}: the weight-gradient "
                     "matmuls pad them with zeros (CUDA's fp8 matmul needs it; a copy of each operand); a "
                     f"micro_batch_size x seq_len / cp that is a multiple of {DIM_MULTIPLE} avoids it")
    return notes


def precompute_scales(model: nn.Module, policy: PrecisionPolicy) -> None:
    """After each optimizer step under FSDP2 float8 all-gather: one all-reduce computes every float8
    weight's scale for the next all-gather (torchao's precompute_float8_dynamic_scale_for_fsdp), where
    each weight's pre-all-gather would otherwise reduce its own amax."""
    if policy.fp8_all_gather:
        precompute_float8_dynamic_scale_for_fsdp(model)
