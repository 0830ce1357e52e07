"""The processes of a run: one, or one per rank started by torchrun.

`run_layout(cfg)` builds the run's Layout (parallel/layout.py) once, on the world this process
belongs to: the launcher's (torchrun's RANK / WORLD_SIZE / LOCAL_RANK environment), an already
initialized default process group (tests), or one process. `init_world(cfg, layout)` then picks
the device and the backend (CUDA: nccl, one device per local rank; CPU: gloo), initializes the
process group when the layout needs one and builds the device mesh. Everything rank-dependent in
training goes through the returned World; there is no module-level state.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh

from trainfit.config import Config, ConfigError
from trainfit.parallel.layout import Layout, build_layout, resolve_world_size
from trainfit.parallel.mesh import build_mesh, dp_mesh

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass
class World:
    """This process's place in the run. `World()` is a single process with no process group."""

    device: torch.device = torch.device("cpu")
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    layout: Layout | None = None
    """How the run is spread over the world (parallel/layout.py); None: one plain process."""
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

    def attach_mesh(self, mesh: DeviceMesh) -> None:
        """Use `mesh` for collectives; the sampler reads the data-parallel rank and size off it."""
        self.mesh = mesh
        data_mesh = dp_mesh(mesh)
        self.dp_rank, self.dp_size = data_mesh.get_local_rank(), data_mesh.size()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def launched() -> bool:
    """Started by torchrun (or another launcher setting its environment)?"""
    return all(name in os.environ for name in LAUNCHER_VARIABLES)


def _place() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from an initialized process group (tests) or the launcher."""
    if dist.is_initialized():
        rank = dist.get_rank()
        return rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank))
    if launched():
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    return None


def _attempt_rendezvous() -> dict[str, Any]:
    """init_process_group's store for this attempt of a torchrun job: the agent's store, under a
    prefix of the attempt's own. torchrun's agent keeps one store across the restarts of an
    elastic job (torch 2.13, though its code says each retry gets a new one), so a restarted group
    would read the dead attempt's gloo/NCCL addresses from it: "connection refused", or a hang in
    connectFullMesh on a busy machine. {} outside torchrun's agent (env:// then does as usual)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=default_pg_timeout)
    return {"store": dist.PrefixStore(f"trainfit/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def run_layout(cfg: Config) -> Layout:
    """The Layout of this run: `cfg` on the world this process belongs to (the launcher's, or one)."""
    place = _place()
    return build_layout(cfg, resolve_world_size(cfg, place[1] if place else 1))


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


def init_world(cfg: Config, layout: Layout) -> World:
    """This process's World for `layout` (run_layout's): device, process group and mesh."""
    reason = layout.untrainable_reason()
    if reason:
        raise ConfigError(reason)
    rank, size, local_rank = _place() or (0, 1, 0)
    if size != layout.world_size:
        raise ConfigError(f"hardware.num_gpus={layout.world_size}: the world has {size} ranks; build the layout "
                          "with run_layout(cfg) in this process")
    device = pick_device(cfg.training.device, local_rank)
    world = World(device=device, rank=rank, size=size, local_rank=local_rank, layout=layout)
    if not layout.needs_process_group:
        return world
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if launched():
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None,
                                    **_attempt_rendezvous())
        else:  # one process that still needs a (1-rank) group: CPU offload through FSDP2
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(minutes=5))
        world.owns_group = True
        atexit.register(world.close)  # `trainfit train` exits without closing; gloo aborts on a live group
    world.attach_mesh(build_mesh(layout, device.type))
    return world
