"""The processes of a run: one, or one per rank started by torchrun.

`init_world(cfg)` is the single entry point. It takes the world size from the launcher (torchrun's
RANK / WORLD_SIZE / LOCAL_RANK environment) or from an already initialized default process group
(tests), fills hardware.num_gpus with it, validates the layout, picks the device and the backend
(CUDA: nccl, one device per local rank; CPU: gloo), initializes the process group when the
layout needs one and builds the device mesh. Everything rank-dependent in training goes through
the returned World; there is no module-level state.
"""

from __future__ import annotations

import atexit
import os
import shlex
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainfit.config import Config, ConfigError, resolve_and_validate
from trainfit.parallel.apply import check_layout, data_parallel_kind
from trainfit.parallel.dims import resolve_parallel_dims
from trainfit.parallel.mesh import build_mesh, dp_mesh

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class World:
    """This process's place in the run. `World()` is a single process with no process group."""

    device: torch.device = torch.device("cpu")
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    mesh: DeviceMesh | None = None
    """The world's DeviceMesh (parallel/mesh.py), when the layout needs a process group."""
    dp_rank: int = 0
    """Rank among the data-parallel ranks: which rows of each global batch this rank reads."""
    dp_size: int = 1
    owns_group: bool = False
    """init_world created the default process group; close() destroys it."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and publishes checkpoints."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) in place across all ranks."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on one (e.g. a signal that reached one rank)."""
        if self.size == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def launched() -> bool:
    """Started by torchrun (or another launcher setting its environment)?"""
    return all(name in os.environ for name in LAUNCHER_VARIABLES)


def launch_command(num_procs: int, gpus_per_node: int) -> str:
    """The torchrun command that runs this trainfit invocation on `num_procs` processes."""
    args = sys.argv[1:] if sys.argv and sys.argv[0].endswith(("trainfit", "__main__.py")) else []
    trainfit_args = " ".join(shlex.quote(a) for a in args) if args else "train CONFIG [--section.field=value ...]"
    if num_procs <= gpus_per_node:
        return f"torchrun --nproc_per_node={num_procs} -m trainfit {trainfit_args}"
    nodes = -(-num_procs // gpus_per_node)
    return (f"torchrun --nnodes={nodes} --nproc_per_node={gpus_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=HOST:29500 -m trainfit {trainfit_args}   (on every node)")


def adopt_world_size(cfg: Config, world_size: int) -> None:
    """Make hardware.num_gpus the launcher's world size, or explain why it cannot be.

    A config that leaves hardware.num_gpus at 1 takes the launcher's world size, and dp_shard is
    derived again (every other degree is necessarily 1 in such a config). A config that names
    another device count is a contradiction we do not guess our way out of.
    """
    hw = cfg.hardware
    if hw.num_gpus == world_size:
        return
    if world_size == 1:
        raise ConfigError(f"hardware.num_gpus={hw.num_gpus}: this layout needs {hw.num_gpus} processes (one "
                          f"per device), and trainfit was started as one; launch it with\n  "
                          f"{launch_command(hw.num_gpus, hw.gpus_per_node)}")
    if hw.num_gpus != 1:
        raise ConfigError(f"hardware.num_gpus={hw.num_gpus}: the launcher started {world_size} processes; "
                          f"start {hw.num_gpus} (torchrun --nproc_per_node={hw.num_gpus} ...) or set "
                          f"--hardware.num_gpus={world_size}")
    hw.num_gpus = world_size
    cfg.parallel.dp_shard = -1
    resolve_and_validate(cfg)


def pick_device(name: str, local_rank: int) -> torch.device:
    """training.device (auto: cuda when available) -> this rank's device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("training.device='cuda': no CUDA device is available; use auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_world(cfg: Config) -> World:
    """This process's World for `cfg` (which gets hardware.num_gpus = the world size)."""
    if dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    elif launched():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        rank, size, local_rank = 0, 1, 0
    adopt_world_size(cfg, size)
    dims = resolve_parallel_dims(cfg)
    check_layout(cfg, dims)
    device = pick_device(cfg.training.device, local_rank)
    world = World(device=device, rank=rank, size=size, local_rank=local_rank)
    if data_parallel_kind(cfg, dims) == "none":
        return world
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if launched():
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # one process that still needs a (1-rank) group: CPU offload through FSDP2
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(minutes=5))
        world.owns_group = True
        atexit.register(world.close)  # `trainfit train` exits without closing; gloo aborts on a live group
    world.mesh = build_mesh(dims, device.type)
    data_mesh = dp_mesh(world.mesh)
    world.dp_rank, world.dp_size = data_mesh.get_local_rank(), data_mesh.size()
    return world
