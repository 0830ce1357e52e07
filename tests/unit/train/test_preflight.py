"""Pre-flight checks: what would fail at the first save or at the first step fails before any work,
naming the field, the value, the numbers and the fix."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from _runs import run_config
from trainfit.config import ConfigError
from trainfit.parallel.resolve import build_layout
from trainfit.train import checkpoint as ckpt
from trainfit.train import preflight


def test_a_file_where_a_folder_belongs_is_named(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="checkpoint.dir=.*file': is a file, not a folder"):
        preflight.check_writable_folder("checkpoint.dir", str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"logging.dir=.*/file is a file, not a folder"):
        preflight.check_writable_folder("logging.dir", str(tmp_path / "file" / "logs"))
    preflight.check_writable_folder("logging.dir", str(tmp_path / "new" / "deeper"))  # missing parents: creatable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created, nothing left behind
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot be written"):
            preflight.check_writable_folder("checkpoint.dir", str(tmp_path / "locked"))


def test_a_disk_too_small_for_a_checkpoint_is_found_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_config(tmp_path)
    need = preflight.checkpoint_bytes(cfg)
    assert need == cfg_params(cfg) * 4 * 3  # fp32 weights + AdamW's two fp32 states
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _: usage(need, need, need // 2))
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*GiB free, a checkpoint of this run takes"):
        preflight.check_disk(cfg)


def cfg_params(cfg) -> int:
    from trainfit.models.params import param_counts

    return param_counts(cfg.model).total


def test_a_run_larger_than_this_machine_is_refused_with_the_change_that_fits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_config(tmp_path, "--training.seq_len=128", "--training.micro_batch_size=8",
                     "--training.global_batch_size=8")
    layout = build_layout(cfg)
    est = preflight.check_memory(cfg, layout, "cpu")  # this machine holds it
    need = est.total_bytes(est.worst)
    monkeypatch.setattr(preflight, "_mem_available", lambda: int(need * 0.9))
    with pytest.raises(ConfigError) as err:
        preflight.check_memory(cfg, layout, "cpu")
    message = str(err.value)
    assert f"needs {need / 2**30:.2f} GiB per rank" in message and "host RAM available" in message
    assert "the cheapest change that fits: selective activation checkpointing" in message and "--force" in message
    monkeypatch.setattr(preflight, "_mem_available", lambda: need // 100)
    with pytest.raises(ConfigError, match="no single setting fits it"):
        preflight.check_memory(cfg, layout, "cpu")
    assert preflight.preflight(cfg, layout, "cpu", force=True).worst.peak == est.worst.peak


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 1 MiB file system (tmpfs; needs root, as on CI), or a skip where it cannot be mounted."""
    mount = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root); the injected-ENOSPC test covers the logic")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_that_fills_mid_save_keeps_the_last_checkpoint(small_tmpfs: Path) -> None:
    """A real full disk: 1 MiB holds one checkpoint of a 256x256 Linear with AdamW (~0.75 MiB), not two."""
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    first = ckpt.save_checkpoint(small_tmpfs, 1, model, optimizer, {"step": 1}, {})
    with pytest.raises(ckpt.CheckpointError, match=r"no space left on the device.*step_00000001 is intact"):
        ckpt.save_checkpoint(small_tmpfs, 2, model, optimizer, {"step": 2}, {})
    assert [p.name for p in small_tmpfs.iterdir()] == [first.name]
    assert ckpt.verify_checkpoint(first) == []
