"""Checkpoints are atomic: a process killed mid-save leaves the last good checkpoint intact."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainfit.train import checkpoint as ckpt


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(root: Path, step: int, seed: int, keep_last: int = 2) -> Path:
    model, optimizer = _model_and_optimizer(seed)
    return ckpt.save_checkpoint(root, step, model, optimizer, {"step": step}, {"seed": seed},
                                keep_last=keep_last)


def test_round_trip_restores_model_optimizer_and_state(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    path = ckpt.save_checkpoint(tmp_path, 7, model, optimizer, {"step": 7, "rng": ckpt.rng_state()}, {"a": 1})
    fresh, fresh_opt = _model_and_optimizer(1)
    state = ckpt.load_checkpoint(path, fresh, fresh_opt)
    assert state["step"] == 7
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    exp_avg = [optimizer.state[p]["exp_avg"] for p in model.parameters()]
    fresh_exp_avg = [fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, fresh_exp_avg, strict=True))
    assert ckpt.load_checkpoint_config(path) == {"a": 1}


def test_keep_last_prunes_and_latest_points_at_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, seed=step, keep_last=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000004"
    assert ckpt.resolve_checkpoint(tmp_path).name == "step_00000004"


def test_resolve_checkpoint_names_the_path_when_empty(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no checkpoint found"):
        ckpt.resolve_checkpoint(tmp_path)


KILLED_MID_SAVE = textwrap.dedent("""
    import sys, torch
    from trainfit.train import checkpoint as ckpt

    root = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(root, 1, model, opt, {"step": 1}, {})
    with torch.no_grad():
        model.weight.add_(1.0)

    def hang(tmp, final):  # the new checkpoint is fully written but not yet renamed into place
        print("MID-SAVE", flush=True)
        sys.stdin.read()  # until killed (no timing: the test kills it once it has read MID-SAVE)

    ckpt._publish = hang
    ckpt.save_checkpoint(root, 2, model, opt, {"step": 2}, {})
""")


def test_kill_mid_save_keeps_last_good_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "MID-SAVE"
    proc.kill()
    proc.communicate()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())  # the half-written save
    torch.manual_seed(0)
    expected = torch.nn.Linear(256, 256)
    loaded = torch.nn.Linear(256, 256)
    assert ckpt.load_checkpoint(ckpt.resolve_checkpoint(tmp_path), loaded, None)["step"] == 1
    assert torch.equal(loaded.weight, expected.weight)
    _save(tmp_path, 3, seed=3)  # the next good save cleans the leftover temp folder
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
