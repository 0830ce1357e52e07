"""Precision policies: dtypes per mode, real low-precision matmuls, loss scaling, pure bf16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainfit.config import ConfigError
from trainfit.precision import precision_policy, step_optimizer

bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(("mode", "param", "compute", "scaling", "master"), [
    ("fp32", fp32, None, False, False),
    ("bf16-mixed", fp32, bf16, False, True),
    ("fp16-mixed", fp32, fp16, True, True),
    ("bf16-pure", bf16, None, False, False),
])
def test_dtypes_per_mode(mode, param, compute, scaling, master):
    policy = precision_policy(mode, "cpu")
    assert (policy.param_dtype, policy.autocast_dtype) == (param, compute)
    assert (policy.uses_loss_scaling, policy.keeps_master_weights) == (scaling, master)
    assert policy.make_grad_scaler().is_enabled() == scaling


def test_unknown_modes_fail_with_the_field_name():
    with pytest.raises(ConfigError, match=r"precision.mode='fp16': choose one of"):
        precision_policy("fp16", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_low_precision_on_a_missing_device_fails_instead_of_silently_running_fp32():
    # torch.autocast would only warn and disable itself here.
    with pytest.raises(ConfigError, match=r"precision.mode='fp16-mixed': device 'cuda' cannot compute"):
        precision_policy("fp16-mixed", "cuda")


@pytest.mark.parametrize(("mode", "dtype"), [("bf16-mixed", bf16), ("fp16-mixed", fp16)])
def test_autocast_runs_matmuls_in_low_precision_on_cpu(mode, dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    with precision_policy(mode, "cpu").autocast():
        out = a @ b
        linear = nn.functional.linear(a, b)
    assert out.dtype == linear.dtype == dtype
    assert torch.equal(out, a.to(dtype) @ b.to(dtype))  # really computed from rounded inputs
    assert not torch.equal(out.float(), a @ b)
    with precision_policy("fp32", "cpu").autocast():
        assert (a @ b).dtype == fp32


def test_fp16_scaler_skips_and_counts_steps_with_inf_gradients():
    policy = precision_policy("fp16-mixed", "cpu")
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = policy.make_grad_scaler()
    skipped = 0
    for step in range(3):
        with policy.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        scaler.scale(loss).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        applied = step_optimizer(optimizer, scaler)
        optimizer.zero_grad(set_to_none=True)
        skipped += not applied
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert applied == changed == (step != 1)
        assert scaler.get_scale() == (scale * 0.5 if step == 1 else scale)
    assert skipped == 1


def test_bf16_pure_model_trains_in_bf16():
    policy = precision_policy("bf16-pure", "cpu")
    model = policy.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    assert {p.dtype for p in model.parameters()} == {bf16}
    with policy.autocast():
        model(torch.randn(2, 8, dtype=bf16)).float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {bf16}
    assert not policy.make_grad_scaler().is_enabled()


def test_mixed_modes_keep_fp32_master_weights():
    policy = precision_policy("bf16-mixed", "cpu")
    model = policy.prepare_model(nn.Linear(8, 8))
    with policy.autocast():
        out = model(torch.randn(2, 8))
    out.float().sum().backward()
    assert out.dtype == bf16
    assert model.weight.dtype == model.weight.grad.dtype == fp32
