"""The DeviceMesh of a run, built from its Layout (parallel/layout.py owns the axis order).

Axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (`Layout.mesh_axes`: size-1 axes left
out, dp_shard always kept). When dp_replicate > 1 the two data-parallel axes are also flattened
into a 1-D "dp" axis: DDP's all-reduce and the data sampler span all of them.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainfit.parallel.layout import Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The world's mesh (needs an initialized default process group of layout.world_size ranks)."""
    axes = layout.mesh_axes()
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
