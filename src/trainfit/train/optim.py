"""Optimizers and learning-rate schedules built from the config.

adamw / adam: torch's, fused where torch has a fused kernel for the device (CUDA, and CPU since torch
2.4; faster than foreach on CPU too: benchmarks/README.md), foreach otherwise; optimizer.fused forces
either way.

adafactor: torch.optim.Adafactor (Shazeer & Stern 2018, arXiv 1804.04235). No first moment; the
second moment of a >= 2-D parameter is factored into a row and a column vector, of a 1-D one kept
whole. Mapping of our config: training.lr (and its schedule) is torch's `lr`, which in Adafactor
caps the *relative* step size rho_t = min(lr, 1/sqrt(t)), the update being max(1e-3, RMS(param)) x
rho_t; the param groups' weight decay is applied decoupled (param *= 1 - lr x wd, as AdamW);
optimizer.betas and optimizer.eps (Adam's) do not apply: torch's own defaults stay (beta2_t = 1 -
t^-0.8, eps = (dtype's machine epsilon, 1e-3), update clipping d = 1). It needs whole parameters:
its column statistics and RMS values span every row, so states sharded by rows (ZeRO-1, FSDP2)
or by tensor parallelism would change the algorithm, and torch's implementation fails on DTensors
anyway (in-place ops on a partial norm; FSDP2 on one rank under CPU offload too):
Layout.untrainable_reason refuses those layouts.

adamw-8bit: torchao.optim.AdamW8bit (torchao 0.18), chosen over bitsandbytes 0.50.2's AdamW8bit by
measurement on this machine: both run on CPU and CUDA and keep the same states (uint8 codes, one
fp32 absmax per 256 values, 32-bit states for tensors under 4096 values), but bitsandbytes fails on
FSDP2's DTensor parameters ("got mixed torch.Tensor and DTensor" in its update op), while torchao
wraps its state subclass in DTensors of the parameter's placements and saves / resumes through DCP
(resumed steps bit-identical to uninterrupted ones, on 2 ranks and on one). Its cost on CPU: its
update is `torch.compile`d per parameter shape (a long first step on a cold compile cache), and each
step calls the compiled function once per tensor, far slower than fused AdamW (benchmarks/README.md).
Its memory is the point, not its CPU speed. Parameters whose (local shard)
size is under 4096 or not a multiple of the block keep plain states in the parameter's dtype.
bf16 stochastic rounding stays off (torchao's default).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainfit.config import ConfigError, OptimizerConfig, TrainingConfig
from trainfit.optimizer_spec import EIGHT_BIT_BLOCK, uses_fused_adam
from trainfit.parallel.data_parallel import group_by_layout


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases (1-D) are not regularised (Loshchilov & Hutter 2019).
    Each of the two is split by how its parameters are laid out (data_parallel.group_by_layout:
    one group unless tensor parallelism mixes plain tensors and DTensors)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": params, "weight_decay": rate}
              for kind, rate in ((decay, weight_decay), (no_decay, 0.0))
              for params in (group_by_layout(kind) or [[]])]
    # an empty group (LoRA trains no 1-D parameter) breaks torch's flattened optimizer state dict; a model
    # of no parameter (a pipeline rank of stages without blocks) keeps one: torch refuses an optimizer of no
    # group, and the step (its learning rate, clipping, the schedule) reads the groups on every rank
    return [g for g in groups if g["params"]] or groups[:1]


def build_optimizer(model: nn.Module, opt: OptimizerConfig, train: TrainingConfig,
                    device_type: str) -> torch.optim.Optimizer:
    return make_optimizer(param_groups(model, train.weight_decay), opt, train, device_type)


def make_optimizer(groups: list[dict], opt: OptimizerConfig, train: TrainingConfig,
                   device_type: str, sharded_loss_scaling: bool = False) -> torch.optim.Optimizer:
    """The configured optimizer over `groups` (model parameters, or ZeRO-1's master shards of them).
    `sharded_loss_scaling`: Layout.sharded_loss_scaling (optimizer_spec.uses_fused_adam says why it
    matters)."""
    fused = uses_fused_adam(opt, device_type, sharded_loss_scaling)
    impl = {"fused": True} if fused else {"foreach": opt.foreach}
    if opt.name == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, betas=opt.betas, eps=opt.eps, **impl)
    if opt.name == "adam":
        # Adam's weight decay is L2 (coupled); keep the groups so norms stay undecayed.
        return torch.optim.Adam(groups, lr=train.lr, betas=opt.betas, eps=opt.eps, **impl)
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=opt.momentum, foreach=opt.foreach)
    if opt.name == "adafactor":
        assert not any(isinstance(p, DTensor) for g in groups for p in g["params"]), \
            "Layout.untrainable_reason refuses Adafactor on sharded parameters"
        return torch.optim.Adafactor(groups, lr=train.lr, foreach=opt.foreach)
    if opt.name == "adamw-8bit":
        return _adamw_8bit(groups, opt, train)
    raise ConfigError(f"optimizer.name={opt.name!r}: not supported; use adamw, adam, sgd, adafactor or adamw-8bit")


def _adamw_8bit(groups: list[dict], opt: OptimizerConfig, train: TrainingConfig) -> torch.optim.Optimizer:
    try:
        from torchao.optim import AdamW8bit
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned
    except ImportError as e:
        raise ConfigError("optimizer.name='adamw-8bit': needs torchao (pip install 'trainfit[lowbit]')") from e
    # Its quantization tables are computed once per process from real tensors (lru_cache): never
    # under the traced estimator's FakeTensorMode, which would cache a table of fakes.
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        get_qmap_signed(), get_qmap_unsigned()
    return AdamW8bit(groups, lr=train.lr, betas=opt.betas, eps=opt.eps, block_size=EIGHT_BIT_BLOCK)


def lr_at(step: int, train: TrainingConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the decay schedule."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    if train.lr_schedule == "constant":
        return train.lr
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    if train.lr_schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.min_lr + (train.lr - train.min_lr) * factor


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainingConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_at(step, train) / train.lr)
