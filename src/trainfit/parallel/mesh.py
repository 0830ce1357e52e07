"""The DeviceMesh of a run, built from its Layout (parallel/layout.py owns the axis order).

Axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (`Layout.mesh_axes`: size-1 axes left
out, dp_shard always kept). Three groupings of the data-parallel ranks are also flattened into
1-D axes, torchtitan's names:
- "dp" (dp_replicate x dp_shard): the ranks that read different rows of each batch;
- "dp_shard_cp" (dp_shard x cp): the ranks over which ZeRO/FSDP shards the model states: the cp
  ranks of a replica hold the same parameters, so they shard them too;
- "dp_cp" (dp_replicate x dp_shard x cp): the ranks over which DDP averages the gradients.
Each exists only when it differs from an axis already there.

Expert parallelism cuts the shard ranks (dp_shard x cp) once more, into a 2-D mesh of its own
(`expert_mesh`): "ep", consecutive blocks of ep ranks that split the experts between them, and
"edp", the ranks holding the same experts, over which FSDP2 shards those (torchtitan's "efsdp").
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainfit.parallel.layout import Layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The world's mesh (needs an initialized default process group of layout.world_size ranks)."""
    axes = layout.mesh_axes()
    mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))
    replicated, context = "dp_replicate" in axes, "cp" in axes
    if replicated:
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
    if context:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if replicated and context:
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    return mesh


def _has(mesh: DeviceMesh, axis: str) -> bool:
    return axis in (mesh.mesh_dim_names or ())


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh of the ranks that read different rows (the sampler's rank and size)."""
    return mesh["dp"] if _has(mesh, "dp_replicate") else mesh["dp_shard"]


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh over which ZeRO/FSDP shards the model states: dp_shard (x cp)."""
    return mesh["dp_shard_cp"] if _has(mesh, "cp") else mesh["dp_shard"]


def ddp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """1-D mesh over which DDP averages gradients: every data-parallel rank (x cp)."""
    if _has(mesh, "cp"):
        return mesh["dp_cp"] if _has(mesh, "dp_replicate") else mesh["dp_shard_cp"]
    return dp_mesh(mesh)


def expert_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The 2-D (edp, ep) mesh over shard_mesh's ranks, in their order: ep fastest, so an expert group
    is ep consecutive shard ranks (perf/comms.py's group_is_intra_node assumes it). Built from the Layout
    and this rank's own (pipeline stage's) mesh. Collective: it creates process groups, so build it
    once per model (train/parallelize.py does)."""
    shards = shard_mesh(mesh)
    return shards._unflatten(0, (shards.size() // layout.ep, layout.ep), ("edp", "ep"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh fully_shard takes: 1-D (shard_mesh) for FSDP, 2-D (dp_replicate, shards) for HSDP."""
    if _has(mesh, "dp_replicate"):
        return mesh["dp_replicate", "dp_shard_cp" if _has(mesh, "cp") else "dp_shard"]
    return shard_mesh(mesh)
