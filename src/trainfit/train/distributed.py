"""The processes of a run: one, or one per rank started by torchrun.

`run_layout(cfg)` builds the run's Layout (parallel/layout.py) once, on the world this process
belongs to: the launcher's (torchrun's RANK / WORLD_SIZE / LOCAL_RANK environment), an already
initialized default process group (tests), or one process, and refuses one that training cannot run
(Layout.untrainable_reason). `init_world(cfg, layout)` then picks the device (CUDA: one per local
rank, modulo the GPUs this process sees) and the backend (CPU: gloo; CUDA: nccl, with gloo for CPU
tensors under memory.offload), initializes the process group with
training.collective_timeout_minutes when the layout needs one and builds the device mesh. Everything
rank-dependent in training goes through the returned World; there is no module-level state.
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
from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout, _world

from trainfit.config import Config, ConfigError
from trainfit.parallel.layout import Layout
from trainfit.parallel.mesh import build_mesh, dp_mesh
from trainfit.parallel.resolve import build_layout, resolve_world_size

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
    pp_mesh: DeviceMesh | None = None
    """Its pipeline axis, under pipeline parallelism."""
    dp_rank: int = 0
    """Rank among the data-parallel ranks: which rows of each global batch this rank reads."""
    dp_size: int = 1
    owns_group: bool = False
    """init_world created the default process group; close() destroys it."""
    collective_timeout: timedelta = default_pg_timeout
    """How long a collective waits for the other ranks (training.collective_timeout_minutes)."""
    device_note: str | None = None
    """Which GPU this rank took and why (pick_device), for the training log; None on the CPU."""

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
        """Use `mesh` for collectives; the sampler reads the data-parallel rank and size off it. The
        pipeline axis is sliced here, once: a DeviceMesh sliced later under fake tensors (the traced
        estimator's step) computes its coordinates from fake values and fails."""
        self.mesh = mesh
        self.pp_mesh = mesh["pp"] if "pp" in (mesh.mesh_dim_names or ()) else None
        data_mesh = dp_mesh(mesh)
        self.dp_rank, self.dp_size = data_mesh.get_local_rank(), data_mesh.size()

    def set_group_timeouts(self) -> None:
        """Give every process group of this process the run's collective timeout. Groups made after
        init_process_group (DeviceMesh's axes, flattened and expert axes) take the backend's
        default instead (torch 2.13: NCCL's is 10 minutes), so call this again once the model's
        groups exist (the Trainer does)."""
        if not dist.is_initialized():
            return
        for group in list(_world.pg_map):
            if not _rank_not_in_group(group):
                _set_pg_timeout(self.collective_timeout, group)

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
    """The Layout of this run: `cfg` on the world this process belongs to (the launcher's, or one);
    one that training cannot run is refused here, before any folder, estimate or process group."""
    place = _place()
    return trainable(build_layout(cfg, resolve_world_size(cfg, place[1] if place else 1)))


def trainable(layout: Layout) -> Layout:
    """`layout`, or Layout.untrainable_reason's named error."""
    reason = layout.untrainable_reason()
    if reason:
        raise ConfigError(reason)
    return layout


def process_group_backend(device_type: str, offload: str) -> str:
    """init_process_group's backend: gloo on the CPU; on CUDA nccl, and under memory.offload gloo
    for CPU tensors too ("cuda:nccl,cpu:gloo"): FSDP2's offloaded gradient shards are CPU DTensors
    whose norm (gradient clipping) is all-reduced, and NCCL has no CPU backend ("No backend type
    associated with device type cpu": pytorch#148532, torchtune#1977)."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload != "none" else "nccl"


def pick_device(name: str, local_rank: int) -> tuple[torch.device, str | None]:
    """training.device (auto: cuda when available) -> (this rank's device, a note saying which GPU
    it took, or None). GPU local_rank modulo the GPUs this process sees: under per-task binding
    (SLURM --gpus-per-task, CUDA_VISIBLE_DEVICES set per rank) each process sees one GPU, index 0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name), None
    if not torch.cuda.is_available():
        raise ConfigError("training.device='cuda': no CUDA device is available; use auto or cpu")
    visible = torch.cuda.device_count()
    index = local_rank % visible
    torch.cuda.set_device(index)
    note = (f"device: cuda:{index} ({torch.cuda.get_device_name(index)}), local rank {local_rank} of a node "
            f"where this process sees {visible} GPU(s)")
    if local_rank >= visible > 1:
        note += f"; more local ranks than visible GPUs: ranks share GPU {index}"
    return torch.device("cuda", index), note


def init_world(cfg: Config, layout: Layout) -> World:
    """This process's World for `layout` (run_layout's): device, process group and mesh."""
    trainable(layout)  # a layout the caller built
    rank, size, local_rank = _place() or (0, 1, 0)
    if size != layout.world_size:
        raise ConfigError(f"hardware.num_gpus={layout.world_size}: the world has {size} ranks; build the layout "
                          "with run_layout(cfg) in this process")
    device, device_note = pick_device(cfg.training.device, local_rank)
    if layout.async_tp and device.type != "cuda":
        raise ConfigError(f"parallel.async_tp=true: torch's micro-pipeline TP needs CUDA devices (symmetric memory), "
                          f"and this run's device is {device.type}; set parallel.async_tp=false")
    timeout = timedelta(minutes=cfg.training.collective_timeout_minutes)
    world = World(device=device, rank=rank, size=size, local_rank=local_rank, layout=layout,
                  collective_timeout=timeout, device_note=device_note)
    if not layout.needs_process_group:
        return world
    if not dist.is_initialized():
        backend = process_group_backend(device.type, layout.offload)
        if launched():
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None, timeout=timeout,
                                    **_attempt_rendezvous())
        else:  # one process that still needs a (1-rank) group: CPU offload through FSDP2
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        world.owns_group = True
        atexit.register(world.close)  # `trainfit train` exits without closing; gloo aborts on a live group
    world.attach_mesh(build_mesh(layout, device.type))
    world.set_group_timeouts()
    return world
