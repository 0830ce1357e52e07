"""Optimizers and learning-rate schedules built from the config."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainfit.config import ConfigError, OptimizerConfig, TrainingConfig
from trainfit.parallel.data_parallel import group_by_layout


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms and biases (1-D) are not regularised (Loshchilov & Hutter 2019).
    Each of the two is split by how its parameters are laid out (data_parallel.group_by_layout:
    one group unless tensor parallelism mixes plain tensors and DTensors)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": params, "weight_decay": rate}
            for kind, rate in ((decay, weight_decay), (no_decay, 0.0))
            for params in (group_by_layout(kind) or [[]])]


def build_optimizer(model: nn.Module, opt: OptimizerConfig, train: TrainingConfig,
                    device_type: str) -> torch.optim.Optimizer:
    return make_optimizer(param_groups(model, train.weight_decay), opt, train, device_type)


def make_optimizer(groups: list[dict], opt: OptimizerConfig, train: TrainingConfig,
                   device_type: str) -> torch.optim.Optimizer:
    """The configured optimizer over `groups` (model parameters, or ZeRO-1's master shards of them)."""
    fused = opt.fused and device_type == "cuda"
    impl = {"fused": True} if fused else {"foreach": opt.foreach}
    if opt.name == "adamw":
        return torch.optim.AdamW(groups, lr=train.lr, betas=opt.betas, eps=opt.eps, **impl)
    if opt.name == "adam":
        # Adam's weight decay is L2 (coupled); keep the groups so norms stay undecayed.
        return torch.optim.Adam(groups, lr=train.lr, betas=opt.betas, eps=opt.eps, **impl)
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=opt.momentum, foreach=opt.foreach)
    raise ConfigError(f"optimizer.name={opt.name!r}: not yet supported by `trainfit train`; "
                      "use adamw, adam or sgd")


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
