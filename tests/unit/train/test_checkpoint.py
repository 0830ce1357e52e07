"""Checkpoints are atomic: a process killed mid-save leaves the last good checkpoint intact."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from trainfit.train import checkpoint as ckpt
from trainfit.train import manifest

CPU = torch.device("cpu")


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
    path = ckpt.save_checkpoint(tmp_path, 7, model, optimizer, {"step": 7, "rng": ckpt.rng_state(CPU)}, {"a": 1})
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


# ---------------------------------------------------------------- integrity and identity

FINGERPRINT = manifest.fingerprint({"0.weight": (32, 16), "2.weight": (4, 32)}, "adamw", "fp32", {"dim": 16})


def _save_run(root: Path, step: int, fingerprint: manifest.Fingerprint = FINGERPRINT) -> Path:
    model, optimizer = _model_and_optimizer(step)
    return ckpt.save_checkpoint(root, step, model, optimizer, {"step": step, "rng": ckpt.rng_state(CPU)}, {},
                                keep_last=3, fingerprint=fingerprint)


def _shard(path: Path) -> Path:
    return next((path / ckpt.DCP_DIR).glob("*.distcp"))


def test_every_file_is_recorded_and_an_intact_checkpoint_verifies(tmp_path: Path) -> None:
    path = _save_run(tmp_path, 1)
    recorded = manifest.read_manifest(path)
    assert recorded.step == 1 and recorded.fingerprint == FINGERPRINT
    assert set(recorded.files) == set(manifest.checkpoint_files(path))
    assert {ckpt.TRAINER_STATE, ckpt.CONFIG_FILE, f"{ckpt.DCP_DIR}/.metadata"} <= set(recorded.files)
    assert ckpt.verify_checkpoint(path) == []


@pytest.mark.parametrize("damage, words", [
    ("garble", "does not match its saved SHA-256"),
    ("truncate", "were saved (truncated"),
    ("delete", "is missing"),
])
def test_damage_is_named_file_and_fault(tmp_path: Path, damage: str, words: str) -> None:
    path = _save_run(tmp_path, 1)
    shard = _shard(path)
    data = bytearray(shard.read_bytes())
    if damage == "garble":  # one flipped byte, same size
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        shard.unlink()
    problems = ckpt.verify_checkpoint(path)
    assert len(problems) == 1 and shard.name in problems[0] and words in problems[0]


def test_a_damaged_newest_checkpoint_gives_way_to_the_previous_one(tmp_path: Path) -> None:
    _save_run(tmp_path, 1)
    newest = _save_run(tmp_path, 2)
    (newest / ckpt.TRAINER_STATE).write_bytes(b"garbage")
    path, warnings = ckpt.choose_checkpoint("auto", tmp_path, FINGERPRINT)
    assert path.name == "step_00000001"
    assert len(warnings) == 1 and "step_00000002 is damaged" in warnings[0] and ckpt.TRAINER_STATE in warnings[0]
    with pytest.raises(ckpt.CheckpointError, match=r"damaged.*--checkpoint.resume=.*step_00000001"):
        ckpt.choose_checkpoint(str(newest), tmp_path, FINGERPRINT)  # named explicitly: refused, the good one offered
    (tmp_path / "step_00000001" / manifest.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="every checkpoint is damaged"):
        ckpt.choose_checkpoint("must", tmp_path, FINGERPRINT)


def test_resume_modes(tmp_path: Path) -> None:
    assert ckpt.choose_checkpoint("auto", tmp_path, FINGERPRINT) == (None, [])
    with pytest.raises(ckpt.CheckpointError, match="checkpoint.resume=must: no checkpoint in"):
        ckpt.choose_checkpoint("must", tmp_path, FINGERPRINT)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint found"):
        ckpt.choose_checkpoint(str(tmp_path / "nowhere"), tmp_path, FINGERPRINT)
    _save_run(tmp_path, 1)
    assert ckpt.choose_checkpoint("never", tmp_path, FINGERPRINT) == (None, [])
    assert ckpt.choose_checkpoint("must", tmp_path, FINGERPRINT)[0].name == "step_00000001"


def test_a_checkpoint_of_another_run_is_refused_with_what_differs(tmp_path: Path) -> None:
    _save_run(tmp_path, 1)
    wider = manifest.fingerprint({"0.weight": (64, 16), "2.weight": (4, 64)}, "sgd", "fp32", {"dim": 64})
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.choose_checkpoint("auto", tmp_path, wider)
    message = str(err.value)
    assert "model.dim=16 in the checkpoint, 64 now" in message and "0.weight [32, 16] -> [64, 16]" in message
    assert "optimizer.name='adamw' in the checkpoint, 'sgd' now" in message
    assert "--checkpoint.resume=never" in message and "--checkpoint.dir" in message
    same_shapes = manifest.fingerprint({"0.weight": (32, 16), "2.weight": (4, 32)}, "adamw", "fp32", {"dim": 16,
                                                                                                      "rope_theta": 1})
    assert ckpt.choose_checkpoint("auto", tmp_path, same_shapes)[0] is not None  # a field that shapes nothing


def test_a_full_disk_mid_save_leaves_no_temp_folder_and_the_last_checkpoint(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    good = _save_run(tmp_path, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match=r"no space left.*step_00000001 is intact"):
        _save_run(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert ckpt.verify_checkpoint(good) == []


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_trainer_state_is_loaded_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _save_run(tmp_path, 1)
    assert ckpt.load_trainer_state(path)["step"] == 1  # the RNG streams are plain tensors and tuples
    torch.save({"step": 1, "payload": _RunsCode()}, path / ckpt.TRAINER_STATE)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="weights-only loading refuses"):
        ckpt.load_trainer_state(path)
    assert not (tmp_path / "PWNED").exists()


def test_rng_state_round_trips() -> None:
    state = ckpt.rng_state(torch.device("cpu"))
    expected = (torch.rand(3), random.random(), np.random.rand(3))
    ckpt.set_rng_state(state, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])


class _FakeCudaGenerators:
    """torch.cuda's per-device generator states on a machine with `visible` GPUs, for the CUDA
    branch of rng_state/set_rng_state on a CPU-only machine."""

    def __init__(self, visible: int) -> None:
        self.states = {i: torch.full((8,), i, dtype=torch.uint8) for i in range(visible)}

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.states[device.index].clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        if device.index not in self.states:  # what torch raises for a device that is not there
            raise IndexError(f"invalid device ordinal {device.index}")
        self.states[device.index] = state.clone()


def test_cuda_rng_state_is_this_ranks_device_and_resumes_where_fewer_gpus_are_visible(monkeypatch, tmp_path) -> None:
    saving = _FakeCudaGenerators(visible=8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", saving.get_rng_state)
    state = ckpt.rng_state(torch.device("cuda", 3))  # local rank 3 of an 8-GPU node
    assert torch.equal(state["cuda"], saving.states[3])
    torch.save(state, tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)

    resuming = _FakeCudaGenerators(visible=1)  # per-task binding: this rank sees one GPU, index 0
    monkeypatch.setattr(torch.cuda, "set_rng_state", resuming.set_rng_state)
    ckpt.set_rng_state(state, torch.device("cuda", 0))
    assert torch.equal(resuming.states[0], saving.states[3])


def test_cuda_rng_state_of_an_older_checkpoint_lists_every_device(monkeypatch) -> None:
    old = {**ckpt.rng_state(torch.device("cpu")), "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]}
    one = _FakeCudaGenerators(visible=1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", one.set_rng_state)
    ckpt.set_rng_state(old, torch.device("cuda", 0))
    assert torch.equal(one.states[0], old["cuda"][0])
    eight = _FakeCudaGenerators(visible=8)
    monkeypatch.setattr(torch.cuda, "set_rng_state", eight.set_rng_state)
    ckpt.set_rng_state(old, torch.device("cuda", 5))
    assert torch.equal(eight.states[5], old["cuda"][5])
