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

Every checkpoint carries `manifest.json` (train/manifest.py): each file's size and SHA-256, and
the run's fingerprint. Loading verifies the files first (split across ranks) and refuses a
checkpoint of another run; the trainer falls back to the previous good checkpoint when the newest
is damaged. Everything is loaded weights-only: no file can run code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
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
from torch.distributed.checkpoint.api import CheckpointException

from trainfit.config import ConfigError
from trainfit.parallel.data_parallel import load_state_dicts, state_dicts
from trainfit.train import manifest
from trainfit.train.distributed import World

STEP_PREFIX = "step_"
TRAINER_STATE = "trainer_state.pt"
CONFIG_FILE = "config.json"
DCP_DIR = "dcp"
FULL_DISK_BYTES = 16 * 2**20
"""A write that failed with less than this free on its disk failed for want of space."""


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or loaded; the message names the file and the way out."""


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random stream of this rank, in types weights-only loading accepts (numpy's key as a
    tensor). On CUDA, the generator of this rank's device only: all visible devices' states would
    not load where fewer are visible (a resume on fewer GPUs, per-task GPU binding)."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore rng_state's streams on `device`. Checkpoints written before it saved one CUDA state
    hold a list (every visible device's): this device's index in it, else the first."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = cuda[index] if index < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda, device)


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
                    world: World | None = None, fingerprint: manifest.Fingerprint | None = None) -> Path:
    """Write the checkpoint of `step` atomically and prune old ones; returns its folder.

    Collective when `world` has several ranks: every rank calls it; rank 0 writes the files other
    than the shards (trainer_state, config, extras) and the manifest, whose checksums the ranks
    compute in turns. A failure on any rank (a full disk) removes the temp folder on every rank's
    behalf and raises CheckpointError: the last good checkpoint stays the latest."""
    world = world or World()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    _together(world, prepare if world.is_main else None, root, tmp)
    tmp = Path(world.broadcast_object(str(tmp)))
    model_sd, optim_sd = state_dicts(model, optimizer)

    def write_shards() -> None:
        with _dcp_quiet():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / DCP_DIR),
                     no_dist=world.size == 1)

    _together(world, write_shards, root, tmp)

    def write_rest() -> None:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        if write_extras is not None:
            write_extras(tmp)

    _together(world, write_rest if world.is_main else None, root, tmp)  # every rank's shards are written
    names = world.broadcast_object(manifest.checkpoint_files(tmp) if world.is_main else None)
    digests: dict[str, Any] = {}
    _together(world, lambda: digests.update({n: manifest.file_digest(tmp / n) for n in names[world.rank::world.size]}),
              root, tmp)
    files = {name: digest for part in world.gather_objects(digests) for name, digest in part.items()}

    def publish() -> None:
        manifest.write_manifest(tmp, step, files, fingerprint or {})
        _fsync_tree(tmp)
        _publish(tmp, final)
        _prune(root, keep_last)

    _together(world, publish if world.is_main else None, root, tmp)
    return final


def _together(world: World, work: Callable[[], None] | None, root: Path, tmp: Path) -> None:
    """Run this rank's part of a save (None: nothing), then agree: if any rank failed, rank 0
    removes the temp folder and every rank raises CheckpointError naming the cause."""
    error: BaseException | None = None
    if work is not None:
        try:
            work()
        except (Exception, CheckpointException) as err:  # reported to every rank below
            error = err
    reasons = [r for r in world.gather_objects(_describe_save_error(error, root) if error else None) if r]
    if not reasons:
        return
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    last = latest_checkpoint(root) if world.is_main else None
    kept = f"; the last good checkpoint {last} is intact" if last else "; no earlier checkpoint exists"
    raise CheckpointError(f"checkpoint.dir={str(root)!r}: saving failed ({reasons[0]}){kept}") from error


def _describe_save_error(error: BaseException, root: Path) -> str:
    if isinstance(error, CheckpointException) and error.failures:  # DCP's: the first rank's own exception
        error = next(iter(error.failures.values()))[0]
    free = shutil.disk_usage(root).free if root.exists() else None
    # torch.save's zip writer reports a full disk as "unexpected pos", not ENOSPC: ask the disk.
    if isinstance(error, OSError) and error.errno == errno.ENOSPC or free is not None and free < FULL_DISK_BYTES:
        left = f"{free / 2**20:.1f} MiB free" if free is not None else "the disk is full"
        return (f"no space left on the device ({left}); free some space or set "
                "checkpoint.dir to a larger disk, then rerun the same command to resume")
    if isinstance(error, PermissionError):
        return f"permission denied: {error}; choose a checkpoint.dir you can write"
    return f"{type(error).__name__}: {error}"


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


def verify_checkpoint(path: Path, world: World | None = None) -> list[str]:
    """What is wrong with a checkpoint's files, in words (empty: intact). Collective: the ranks
    check the files in turns. A checkpoint without a manifest cannot be verified: one problem."""
    world = world or World()
    try:
        recorded = manifest.read_manifest(path).files if world.is_main else None
        error = None
    except manifest.ManifestError as err:
        recorded, error = None, str(err)
    recorded, error = world.broadcast_object((recorded, error))
    if error:
        return [error]
    names = sorted(recorded)[world.rank::world.size]
    mine = [problem for name in names if (problem := manifest.file_problem(path, name, recorded[name]))]
    return [problem for part in world.gather_objects(mine) for problem in part]


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    world: World | None = None) -> dict[str, Any]:
    """Load model (and optimizer) state in place, resharded to this layout; returns the trainer
    state. Collective when `world` has several ranks. Call verify_checkpoint first."""
    world = world or World()
    if optimizer is None:  # a model's own: what trains (PEFT checkpoints hold its adapters only)
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        state = {"model": {k: v for k, v in model.state_dict().items() if k in trained or not trained}}
    else:
        model_sd, optim_sd = state_dicts(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    with _dcp_quiet():
        dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=world.size == 1)
    if optimizer is None:
        model.load_state_dict(state["model"], strict=len(state["model"]) == len(model.state_dict()))
    elif state["model"]:  # a rank without parameters (data_parallel.state_dicts) has nothing to set
        load_state_dicts(model, optimizer, state["model"], state["optimizer"])
    return load_trainer_state(path)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer's state (step, schedule, scaler, sampler, RNG), loaded weights-only."""
    try:
        return torch.load(path / TRAINER_STATE, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path / TRAINER_STATE}: holds objects that weights-only loading refuses (saved by "
                              "an older trainfit, or not ours); it is never unpickled with code. Start over with "
                              "checkpoint.resume=never or another checkpoint.dir") from err


def load_checkpoint_config(path: Path) -> dict[str, Any]:
    return json.loads((path / CONFIG_FILE).read_text())


def choose_checkpoint(spec: str, root: str | Path, fingerprint: manifest.Fingerprint,
                      world: World | None = None) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from under checkpoint.resume=`spec` (auto | never | must | a path)
    and the warnings to show. Collective. A damaged newest checkpoint gives way to the previous
    intact one (with a warning); a checkpoint of another run (its fingerprint differs) or a damaged
    one named explicitly is a CheckpointError that says what differs and how to go on."""
    world = world or World()
    if spec == "never":
        return None, []
    explicit = spec not in ("auto", "must")
    found, error = None, None
    if world.is_main:
        try:
            found = [str(resolve_checkpoint(spec))] if explicit else [str(p) for p in reversed(list_checkpoints(root))]
        except ConfigError as err:
            error = str(err)
    found, error = world.broadcast_object((found, error))
    if error:
        raise CheckpointError(f"checkpoint.resume={spec!r}: {error}")
    candidates = [Path(p) for p in found]
    if not candidates:
        if spec == "must":
            raise CheckpointError(f"checkpoint.resume=must: no checkpoint in checkpoint.dir={str(root)!r}; "
                                  "use checkpoint.resume=auto to start a new run when there is none")
        return None, []
    warnings_: list[str] = []
    for path in candidates:
        problems = verify_checkpoint(path, world)
        if not problems:
            _check_same_run(path, fingerprint)
            return path, warnings_
        damage = f"{path} is damaged: {'; '.join(problems[:3])}"
        if explicit:
            earlier = [p for p in list_checkpoints(path.parent) if p.name < path.name]
            offer = f"; resume from the previous one with --checkpoint.resume={earlier[-1]}" if earlier else ""
            raise CheckpointError(f"checkpoint.resume={spec!r}: {damage}{offer}, or start over with "
                                  "--checkpoint.resume=never")
        warnings_.append(f"warning: {damage}; trying the previous checkpoint")
    raise CheckpointError(f"checkpoint.dir={str(root)!r}: every checkpoint is damaged ({warnings_[-1][9:]}); "
                          "start over with --checkpoint.resume=never or choose another checkpoint.dir")


def _check_same_run(path: Path, fingerprint: manifest.Fingerprint) -> None:
    """Refuse a checkpoint whose fingerprint differs from this run's, saying what differs and the choices."""
    differences = manifest.fingerprint_differences(manifest.read_manifest(path).fingerprint, fingerprint)
    if not differences:
        return
    raise CheckpointError(
        f"{path} was saved by another run: " + "; ".join(differences) + ". Either keep both runs (a new "
        "--checkpoint.dir and --logging.dir, e.g. runs/NAME/checkpoints and runs/NAME), start this run over "
        "in this folder (--checkpoint.resume=never; its saves replace the other run's checkpoints), or "
        f"resume the other run with its own settings (saved in {path / CONFIG_FILE})")
