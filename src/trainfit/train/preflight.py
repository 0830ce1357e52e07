"""Checks `trainfit train` makes before any work: the folders it will write, the disk its
checkpoints need, and the memory the estimate says a step needs against what this machine has.

A run that would fail at its first save after an hour, or be killed by the kernel's OOM killer,
fails here instead, with the numbers and the change that makes it work. `--force` skips the memory
check (estimates can be wrong); folder and disk checks cannot be skipped.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path

from trainfit.config import Config, ConfigError
from trainfit.estimate import Estimate, estimate, fitting_changes
from trainfit.models.params import param_counts
from trainfit.optimizer_spec import OPTIMIZER_STATES
from trainfit.parallel.layout import Layout

GIB = 1024**3


def nearest_existing(path: str | Path) -> Path:
    """`path` made absolute, or its closest ancestor that exists (what a write there would create under)."""
    existing = Path(path).absolute()
    while not existing.exists():
        existing = existing.parent
    return existing


def check_writable_folder(field: str, value: str) -> None:
    """`value` is a folder this process can write, or one it can create (nothing is created here:
    a run that fails later must not leave folders behind)."""
    path = Path(value).absolute()
    fix = f"set {field} to a folder you can write"
    existing = nearest_existing(path)
    if not existing.is_dir():
        where = "is a file, not a folder" if existing == path else f"{existing} is a file, not a folder"
        raise ConfigError(f"{field}={value!r}: {where}; {fix}")
    if existing == path:
        probe = path / f".trainfit-write-test-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"{field}={value!r}: cannot be written ({err.strerror or err}); {fix}") from err
    elif not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}={value!r}: cannot be created ({existing} is not writable); {fix}")


def checkpoint_bytes(cfg: Config) -> int:
    """One checkpoint on disk, all ranks together: the weights the optimizer updates (fp32, or
    bf16 under bf16-pure) and its states in the same dtype (AdamW: 2 per parameter)."""
    weight = 2 if cfg.precision.mode == "bf16-pure" else 4
    return param_counts(cfg.model).total * weight * (1 + OPTIMIZER_STATES[cfg.optimizer.name])


def check_disk(cfg: Config) -> None:
    """The checkpoint folder's disk has room for one more checkpoint (a save writes the new one
    before pruning the oldest)."""
    need = checkpoint_bytes(cfg)
    free = shutil.disk_usage(nearest_existing(cfg.checkpoint.dir)).free
    if free < need:
        raise ConfigError(
            f"checkpoint.dir={cfg.checkpoint.dir!r}: its disk has {free / GIB:.2f} GiB free, a checkpoint of this "
            f"run takes ~{need / GIB:.2f} GiB; free space or set checkpoint.dir to a larger disk")


def available_memory(device_type: str) -> tuple[int, str]:
    """(bytes this rank can still use, what they are): free device memory on CUDA, else the host's
    MemAvailable shared by the ranks on this node."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free, "free on this GPU"
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    available = _mem_available()
    return available // ranks_here, ("host RAM available" + (f", shared by {ranks_here} ranks" if ranks_here > 1
                                                             else ""))


def _mem_available() -> int:
    """/proc/meminfo's MemAvailable (what can be allocated without swapping), or total RAM elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(cfg: Config, layout: Layout, device_type: str) -> Estimate:
    """The analytic estimate against what this rank can use; ConfigError with the numbers and the
    changes that would fit when it does not."""
    est = estimate(cfg, layout)
    limit, what = available_memory(device_type)
    need = est.total_bytes(est.worst)
    if need <= limit:
        return est
    changes = fitting_changes(replace(est, device_memory=limit), trainable=True)
    fix = (f"the cheapest change that fits: {changes[0]}" + (f" (or: {'; '.join(changes[1:3])})" if len(changes) > 1
                                                              else "")
           if changes else "no single setting fits it: use a smaller model, a shorter training.seq_len or a "
                           "smaller training.micro_batch_size")
    raise ConfigError(f"the estimate needs {need / GIB:.2f} GiB per rank (peak + reserved margin), {limit / GIB:.2f} "
                      f"GiB {what}: {fix}; --force starts anyway")


def preflight(cfg: Config, layout: Layout, device_type: str, *, force: bool = False) -> Estimate:
    """Every check, cheapest first; returns the analytic estimate."""
    check_writable_folder("checkpoint.dir", cfg.checkpoint.dir)
    check_writable_folder("logging.dir", cfg.logging.dir)
    check_disk(cfg)
    if force:
        return estimate(cfg, layout)
    return check_memory(cfg, layout, device_type)
