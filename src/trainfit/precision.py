"""Numeric precision of a training step: parameter dtype, autocast, loss scaling.

- fp32: everything fp32.
- bf16-mixed / fp16-mixed: parameters (and so gradients and optimizer states) stay fp32 and act as
  the master weights; autocast runs matmuls and other autocast-listed ops in the low dtype.
  fp16's narrow exponent range needs dynamic loss scaling (GradScaler): the loss is multiplied
  before backward, gradients are unscaled before the step, and steps with inf/nan are skipped.
- bf16-pure: parameters, gradients and optimizer states all bf16, no autocast (half the memory of
  model states, at the cost of lossy weight updates).
- fp8-mixed: not yet supported (will be torchao float8 matmuls on top of bf16-mixed).

Under FSDP2 the same split is expressed by MixedPrecisionPolicy(param_dtype=autocast_dtype), under
ZeRO-1 by parallel/zero.py (16-bit parameters, fp32 master shards; bf16-pure: bf16 shards and
states); autocast is then off. This module is the single-device / DDP form.
"""

from __future__ import annotations

import contextlib
import typing
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from trainfit.config import ConfigError, PrecisionMode

MODES: tuple[str, ...] = typing.get_args(PrecisionMode)


@dataclass(frozen=True)
class PrecisionPolicy:
    """What one precision mode means for a device: dtypes, autocast and loss scaling."""

    mode: str
    device_type: str
    param_dtype: torch.dtype
    """dtype of the parameters (and so of gradients and optimizer states)."""
    autocast_dtype: torch.dtype | None
    """dtype autocast computes in, or None when autocast is off."""
    uses_loss_scaling: bool
    """fp16 only: gradients would underflow without a dynamically scaled loss."""
    keeps_master_weights: bool
    """The fp32 parameters are master weights that autocast casts down per op (*-mixed)."""

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """Context to run the forward (and loss) in; backward needs none, it follows the forward."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def make_grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled for fp16-mixed only; disabled, all its methods are pass-throughs."""
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_loss_scaling)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Cast the model in place to the parameter dtype (bf16-pure); a no-op for other modes.

        Floating buffers are cast too (as `model.to(dtype)` does): a fp32 buffer such as a RoPE
        table would otherwise promote bf16 activations back to fp32.
        """
        if self.param_dtype != torch.float32:
            model.to(self.param_dtype)
        return model


def precision_policy(mode: str, device_type: str) -> PrecisionPolicy:
    """The policy for `precision.mode` on a device type ("cpu", "cuda", ...); fails early and clearly."""
    if mode == "fp8-mixed":
        raise ConfigError("precision.mode='fp8-mixed': not yet supported by the training loop "
                          "(torchao float8 conversion is pending); use bf16-mixed")
    if mode not in MODES:
        raise ConfigError(f"precision.mode={mode!r}: choose one of " + " | ".join(MODES))
    low = {"fp16-mixed": torch.float16, "fp32": None}.get(mode, torch.bfloat16)
    if low is not None:
        _check_device_supports(mode, device_type, low)
    mixed = mode.endswith("-mixed")
    return PrecisionPolicy(
        mode=mode,
        device_type=device_type,
        param_dtype=torch.bfloat16 if mode == "bf16-pure" else torch.float32,
        autocast_dtype=low if mixed else None,
        uses_loss_scaling=mode == "fp16-mixed",
        keeps_master_weights=mixed,
    )


def _check_device_supports(mode: str, device_type: str, dtype: torch.dtype) -> None:
    """Raise if `device_type` cannot compute in `dtype`.

    torch.autocast only *warns* and silently disables itself for a dtype the device lacks (or
    when CUDA is absent), and raises for bf16 on pre-Ampere GPUs; we turn all of these into one
    ConfigError rather than train in a precision nobody asked for.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            torch.autocast(device_type, dtype=dtype)
        except (RuntimeError, UserWarning) as err:
            other = "fp16-mixed" if dtype == torch.bfloat16 else "bf16-mixed"
            raise ConfigError(f"precision.mode={mode!r}: device {device_type!r} cannot compute in "
                              f"{dtype} ({err}); use {other} or fp32") from err


def step_optimizer(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """`scaler.step` + `scaler.update`; returns False when the step was skipped (inf/nan gradients).

    A skipped step is detected by the scale having shrunk, which happens exactly on inf/nan. The
    `get_scale()` host sync costs nothing extra: `scaler.step` already syncs on the inf check.
    """
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale
