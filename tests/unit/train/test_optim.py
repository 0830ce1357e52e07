"""Optimizer groups and learning-rate schedules."""

from __future__ import annotations

import pytest
import torch

from trainfit.config import ConfigError, load_config
from trainfit.train.optim import build_optimizer, lr_at, param_groups


def test_no_decay_on_norms_and_biases() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(4, 4)]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3  # bias, norm weight, norm bias


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedule_warms_up_then_decays_to_min_lr(schedule: str) -> None:
    t = load_config(None, [f"--training.lr_schedule={schedule}", "--training.steps=100",
                           "--training.warmup_steps=10", "--training.lr=1e-3", "--training.min_lr=1e-4"]).training
    lrs = [lr_at(s, t) for s in range(101)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10], strict=False))
    if schedule == "constant":
        assert set(lrs[10:]) == {1e-3}
    else:
        assert lrs[100] == pytest.approx(1e-4)
        assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    if schedule == "cosine":
        assert lrs[55] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd"])
def test_build_optimizer_uses_config(name: str) -> None:
    cfg = load_config(None, [f"--optimizer.name={name}", "--optimizer.momentum=0.8"])
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, cfg.optimizer, cfg.training, "cpu")
    assert type(opt).__name__.lower() == name
    if name == "sgd":
        assert opt.param_groups[0]["momentum"] == 0.8
    else:
        assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_8bit_adam_is_refused_clearly() -> None:
    cfg = load_config(None, ["--optimizer.name=adamw-8bit"])
    with pytest.raises(ConfigError, match="optimizer.name='adamw-8bit': not yet supported"):
        build_optimizer(torch.nn.Linear(2, 2), cfg.optimizer, cfg.training, "cpu")
