"""Optimizer groups and learning-rate schedules."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainfit.configure import load_config
from trainfit.optimizer_spec import uses_fused_adam
from trainfit.train.optim import build_optimizer, build_scheduler, lr_at, param_groups


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


@pytest.mark.parametrize(("fused", "device", "expect"), [
    (None, "cpu", True), (None, "cuda", True), (None, "mps", False), (False, "cpu", False), (True, "cpu", True)])
def test_fused_adamw_by_device_unless_forced(fused: bool | None, device: str, expect: bool) -> None:
    cfg = load_config(None, [] if fused is None else [f"--optimizer.fused={str(fused).lower()}"])
    assert uses_fused_adam(cfg.optimizer, device) is expect
    if device == "cpu":
        opt = build_optimizer(torch.nn.Linear(4, 4), cfg.optimizer, cfg.training, device)
        assert opt.defaults["fused"] is (True if expect else None)
        assert opt.defaults["foreach"] is (None if expect else True)


def test_fp16_under_fsdp_takes_foreach_unless_forced() -> None:
    """ShardedGradScaler's [1]-shaped inf flag breaks torch 2.13's fused step (optimizer_memory.uses_fused_adam)."""
    cfg = load_config(None, [])
    assert uses_fused_adam(cfg.optimizer, "cpu", sharded_loss_scaling=True) is False
    forced = load_config(None, ["--optimizer.fused=true"]).optimizer
    assert uses_fused_adam(forced, "cpu", sharded_loss_scaling=True) is True


def test_adafactor_maps_the_config() -> None:
    cfg = load_config(None, ["--optimizer.name=adafactor", "--training.lr=0.02", "--training.weight_decay=0.1"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, cfg.optimizer, cfg.training, "cpu")
    assert isinstance(opt, torch.optim.Adafactor)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.param_groups[0]["lr"] == 0.02
    assert opt.param_groups[0]["foreach"] is True
    model[0].weight.grad = torch.ones(4, 8)
    opt.step()
    state = opt.state[model[0].weight]
    assert state["row_var"].shape == (4, 1) and state["col_var"].shape == (1, 8)


def _tiny_regression(name: str, steps: int) -> list[float]:
    """Loss of a 64 -> 128 linear map (a matrix of 8192 values: 8-bit states; its bias: plain ones)
    fitting a fixed random target. The same shapes as the checkpoint test: torchao compiles once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)
    x, y = torch.randn(32, 64), torch.randn(32, 128)
    cfg = load_config(None, [f"--optimizer.name={name}", "--training.lr=1e-2", "--optimizer.betas=0.9,0.99"])
    opt = build_optimizer(model, cfg.optimizer, cfg.training, "cpu")
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_adamw_8bit_tracks_adamw() -> None:
    """torchao's 8-bit states, quantized block-wise, follow fp32 AdamW's trajectory within 2% of
    the loss over 8 steps, on 8-bit states indeed."""
    exact, eight_bit = _tiny_regression("adamw", 8), _tiny_regression("adamw-8bit", 8)
    assert eight_bit[-1] < 0.7 * eight_bit[0]
    assert eight_bit == pytest.approx(exact, rel=0.02)
    assert eight_bit != exact


def test_adamw_8bit_resumes_from_a_dcp_checkpoint(tmp_path) -> None:
    """torchao's states are tensor subclasses (uint8 codes, fp32 scales): DCP saves and loads them
    through parallel/data_parallel.state_dicts, and resumed steps match uninterrupted ones."""
    import torch.distributed.checkpoint as dcp

    from trainfit.parallel.data_parallel import load_state_dicts, local_state_bytes, state_dicts

    cfg = load_config(None, ["--optimizer.name=adamw-8bit", "--training.lr=1e-2"])
    x, y = torch.randn(16, 64), torch.randn(16, 128)

    def setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(64, 128)
        return model, build_optimizer(model, cfg.optimizer, cfg.training, "cpu")

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = setup(0)
    for _ in range(3):
        step(model, opt)
    # weight: uint8 codes + an fp32 scale per 256 values + a 1 KiB code table, twice; bias: two
    # fp32 states (under 4096 values); a step each
    assert local_state_bytes(model, opt)["optimizer"] == 2 * (8192 + 4 * 32 + 1024) + 2 * 4 * 128 + 2 * 4
    model_sd, optim_sd = state_dicts(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path), no_dist=True)
    expected = [step(model, opt) for _ in range(2)]
    other, other_opt = setup(1)
    step(other, other_opt)  # its own states, to be overwritten
    model_sd, optim_sd = state_dicts(other, other_opt)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp_path), no_dist=True)
    load_state_dicts(other, other_opt, model_sd, optim_sd)
    assert type(other_opt.state[other.weight]["exp_avg"]).__name__ == "OptimState8bit"
    assert [step(other, other_opt) for _ in range(2)] == expected


def test_the_schedule_refills_adamw_8bits_tensor_lr_in_place() -> None:
    """torchao's AdamW8bit keeps each group's lr a 0-d tensor and refuses a float; torch's LambdaLR
    fills it in place with the schedule's value (its base lr a copy, not the same tensor)."""
    cfg = load_config(None, ["--optimizer.name=adamw-8bit", "--training.steps=6", "--training.warmup_steps=2",
                             "--training.lr=1e-2", "--training.min_lr=1e-3"])
    opt = build_optimizer(torch.nn.Linear(64, 128), cfg.optimizer, cfg.training, "cpu")
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor)
    scheduler = build_scheduler(opt, cfg.training)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": no gradients here
        for _ in range(6):
            seen.append(float(opt.param_groups[0]["lr"]))
            scheduler.step()
    assert opt.param_groups[0]["lr"] is lr
    assert seen == pytest.approx([lr_at(step, cfg.training) for step in range(6)], rel=1e-6)
