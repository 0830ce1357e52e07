"""Numeric precision of a training step: parameter dtype, autocast, loss scaling.

- fp32: everything fp32.
- bf16-mixed / fp16-mixed: parameters (and so gradients and optimizer states) stay fp32 and act as
  the master weights; autocast runs matmuls and other autocast-listed ops in the low dtype.
  fp16's narrow exponent range needs dynamic loss scaling (GradScaler): the loss is multiplied
  before backward, gradients are unscaled before the step, and steps with inf/nan are skipped.
- bf16-pure: parameters, gradients and optimizer states all bf16, no autocast (half the memory of
  model states, at the cost of lossy weight updates).
- fp8-mixed: bf16-mixed, plus torchao's float8 training (`convert_to_float8`): every nn.Linear
  whose dims fp8 can take becomes a torchao Float8Linear, whose three matmuls (output, input
  gradient, weight gradient) cast both operands to fp8 with dynamic scales (precision.fp8_scaling:
  one per tensor or one per row) and run torch._scaled_mm. The output projection stays in bf16
  (as torchtitan keeps it: the logits are where fp8's error would land undiluted), and so do
  linears whose dims are not multiples of 16 (_scaled_mm's constraint) and anything that is not an
  nn.Linear (MoE's grouped experts). float8.py converts (train/parallelize.py calls it) and lists what
  stays bf16 when training starts. Under FSDP2, precision.fp8_all_gather all-gathers the float8
  weights in fp8 (tensorwise only).

Under FSDP2 the same split is expressed by MixedPrecisionPolicy(param_dtype=autocast_dtype), under
ZeRO-1 by parallel/zero.py (16-bit parameters, fp32 master shards; bf16-pure: bf16 shards and
states); autocast is then off. This module is the single-device / DDP form.
"""

from __future__ import annotations

import contextlib
import importlib.util
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
    fp8_scaling: str | None = None
    """fp8-mixed: torchao's float8 recipe (tensorwise | rowwise); None: no float8 linears."""
    fp8_all_gather: bool = False
    """fp8-mixed under FSDP2: the float8 weights are all-gathered in fp8 (tensorwise only)."""

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


def precision_policy(mode: str, device_type: str, *, fp8_scaling: str = "tensorwise",
                     fp8_all_gather: bool = False) -> PrecisionPolicy:
    """The policy for `precision.mode` on a device type ("cpu", "cuda", ...); fails early and clearly.
    `fp8_scaling`, `fp8_all_gather`: precision.fp8_scaling and fp8_all_gather, read under fp8-mixed."""
    if mode == "fp8-mixed":
        _check_torchao()
        if fp8_all_gather and fp8_scaling != "tensorwise":
            raise ConfigError(f"precision.fp8_all_gather=True: torchao all-gathers float8 weights with one scale "
                              f"per tensor, and precision.fp8_scaling={fp8_scaling!r}; set fp8_scaling='tensorwise' "
                              "or fp8_all_gather=false")
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
        fp8_scaling=fp8_scaling if mode == "fp8-mixed" else None,
        fp8_all_gather=fp8_all_gather and mode == "fp8-mixed",
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


def _check_torchao() -> None:
    """fp8-mixed needs torchao (the `lowbit` extra): fail with the fix, not an ImportError mid-build."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("precision.mode='fp8-mixed': needs torchao, which is not installed; "
                          "pip install trainfit[lowbit], or use bf16-mixed")


def step_optimizer(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> bool:
    """`scaler.step` + `scaler.update`; returns False when the step was skipped (inf/nan gradients).

    A skipped step is detected by the scale having shrunk, which happens exactly on inf/nan. The
    `get_scale()` host sync costs nothing extra: `scaler.step` already syncs on the inf check.
    """
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() >= scale
