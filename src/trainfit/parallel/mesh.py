"""The DeviceMesh of a run, built from ParallelDims (parallel/dims.py, the single source of degrees).

Axes, outermost first, as dims.py lays the world out: pp, dp_replicate, dp_shard, cp, tp. An axis
of size 1 is left out, except dp_shard, which always exists: FSDP shards over it, even on one
rank (CPU offload of a single process). When dp_replicate > 1 the two data-parallel axes are
also flattened into a 1-D "dp" axis: DDP's all-reduce and the data sampler span all of them.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainfit.parallel.dims import ParallelDims

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def mesh_axes(dims: ParallelDims) -> dict[str, int]:
    """The mesh's named axes and their sizes, outermost first."""
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
             "tp": dims.tp}
    return {axis: sizes[axis] for axis in AXES if sizes[axis] > 1 or axis == "dp_shard"}


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The world's mesh (needs an initialized default process group of dims.num_gpus ranks)."""
    axes = mesh_axes(dims)
    mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))
    if "dp_replicate" in axes:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of all data-parallel ranks (DDP's all-reduce group; the sampler's rank and size)."""
    return mesh["dp"] if "dp_replicate" in (mesh.mesh_dim_names or ()) else mesh["dp_shard"]


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh fully_shard takes: 1-D (dp_shard) for FSDP, 2-D (dp_replicate, dp_shard) for HSDP."""
    if "dp_replicate" in (mesh.mesh_dim_names or ()):
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
