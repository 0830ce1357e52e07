"""Checkpoints: model and optimizer through torch.distributed.checkpoint (DCP), the rest of the
trainer's state (schedule, loss scaler, data position, RNG streams) beside them.

Layout: `<dir>/step_XXXXXXXX/{dcp/, trainer_state.pt, config.json, tokenizer files}`. A save is
written to a hidden temp folder, fsynced and renamed into place; the newest `step_*` folder is
the latest checkpoint, so a crash at any moment leaves the last good checkpoint untouched.

With several ranks: rank 0 creates the temp folder and names it to all; every rank writes its
shards into it (dcp.save); rank 0 adds the trainer state, config and tokenizer; after a barrier
(every rank's files are complete) rank 0 fsyncs and renames; a second barrier keeps any rank from
running ahead of the rename. A rank killed at any point leaves only a temp folder, which the
next successful save removes.

Model and optimizer are saved as DCP state dicts keyed by parameter name (the optimizer
flattened per parameter: `state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), sharded tensors as
DTensors (parallel/data_parallel.state_dicts): nothing in the files depends on the layout, so a
checkpoint resumes on another world size or layout (DDP, ZeRO-1's master and state shards, FSDP/HSDP
shards, one plain process), and `trainfit export` loads it into one process. The weights saved
are the ones the optimizer updates: fp32 under *-mixed (one process's and DDP's fp32 parameters,
FSDP2's sharded parameters, ZeRO-1's master shards), bf16 under bf16-pure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from trainfit.config import ConfigError
from trainfit.parallel.data_parallel import load_state_dicts, state_dicts
from trainfit.train.distributed import World

STEP_PREFIX = "step_"
TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.json"
DCP_DIR = "dcp"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns that it runs without a process group; single-process use is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], config: dict[str, Any],
                    write_extras: Callable[[Path], None] | None = None, keep_last: int = 2,
                    world: World | None = None) -> Path:
    """Write the checkpoint of `step` atomically and prune old ones; returns its folder.

    Collective when `world` has several ranks: every rank calls it; rank 0 writes the files other
    than the shards (trainer_state, config, extras)."""
    world = world or World()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = None
    if world.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    tmp = Path(world.broadcast_object(str(tmp)))
    model_sd, optim_sd = state_dicts(model, optimizer)
    with _dcp_quiet():
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / DCP_DIR),
                 no_dist=world.size == 1)
    if world.is_main:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        if write_extras is not None:
            write_extras(tmp)
    world.barrier()  # every rank's shards are written (DCP's writer fsyncs each file it writes)
    if world.is_main:
        _fsync_tree(tmp)
        _publish(tmp, final)
        _prune(root, keep_last)
    world.barrier()
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temp folder into place (replacing an older save of the same step)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Completed checkpoints under root, oldest first (temp folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))


def _prune(root: Path, keep_last: int) -> None:
    for stale in root.iterdir():
        if stale.name.startswith((".tmp-", ".old-")) and not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under root, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint folder or a root of checkpoints (then its latest); fail clearly otherwise."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ConfigError(f"checkpoint {str(path)!r}: no checkpoint found there; pass a checkpoint "
                          "folder (step_XXXXXXXX) or the checkpoint.dir of a run that saved one")
    return latest


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    world: World | None = None) -> dict[str, Any]:
    """Load model (and optimizer) state in place, resharded to this layout; returns the trainer
    state. Collective when `world` has several ranks."""
    world = world or World()
    if optimizer is None:
        state = {"model": model.state_dict()}
    else:
        model_sd, optim_sd = state_dicts(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    with _dcp_quiet():
        dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=world.size == 1)
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        load_state_dicts(model, optimizer, state["model"], state["optimizer"])
    return torch.load(path / TRAINER_STATE, weights_only=False)


def load_checkpoint_config(path: Path) -> dict[str, Any]:
    return json.loads((path / CONFIG_FILE).read_text())
