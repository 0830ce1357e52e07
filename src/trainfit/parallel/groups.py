"""The process groups one rank of a Layout belongs to, as parallel/mesh.py has torch build them. Torch-free.

Each group is a communicator of its own on NCCL, with buffers of its own (memory/closed_form/comm_buffers.py
prices them), so the count matters to memory. What torch 2.13 does (torch/distributed/device_mesh.py,
DeviceMesh._init_one_process_group), for each mesh axis, each flattened axis (`_flatten`: dp,
dp_shard_cp, dp_cp) and each axis of the expert mesh (`_unflatten`: edp, ep):
- an axis spanning the whole world reuses the default group (init_process_group's) instead of a new one;
- any other axis gets a new group of its own, even one over the same ranks as another axis (under
  DDP with dp_replicate > 1 and dp_shard = 1, "dp" and "dp_replicate" hold the same ranks, in two
  groups) and even one of size 1 (dp_shard is always an axis).
A size-1 group has no peer, so NCCL connects nothing for it: it is left out here. The default group
counts when the world has more than one rank: the trainer's metrics and barriers run on it
(train/distributed.World). tests/distributed/test_process_groups.py checks the count against the
groups torch registers for a real mesh.

Every group's ranks are evenly spaced in the world (the mesh orders them pp, dp_replicate, dp_shard,
cp, tp, outermost first, and a flattened or expert axis joins adjacent ones), so a group is its size
and its stride, which say whether it stays inside a node (perf/comms.span_is_intra_node).

A collective over some mesh axes (parallel/collectives.CollectiveCall.axes) runs on one of these
groups (`group_of`), the one parallel/mesh.py's dp_mesh, shard_mesh, ddp_mesh and fsdp_mesh pick;
some groups torch makes carry none (under FSDP with dp_replicate > 1, "dp": the sampler reads its
rank and size, nothing communicates on it).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from trainfit.parallel.layout import AXES, Layout

FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}
"""parallel/mesh.build_mesh's flattened axes and the axes each joins."""


class Group(NamedTuple):
    name: str
    """"world" (the default group), a mesh axis, a flattened axis or an expert axis (edp, ep)."""
    size: int
    stride: int
    """Ranks between two consecutive members of the group."""
    axes: tuple[str, ...] = ()
    """The mesh axes it joins (parallel/layout.AXES; ("edp",) or ("ep",) for an expert axis; every
    axis for the world)."""


def _stride(layout: Layout, axes: tuple[str, ...]) -> int:
    """Ranks between neighbours along the innermost of `axes`: the product of the axes inside it."""
    inner = AXES[AXES.index(axes[-1]) + 1:]
    return math.prod(getattr(layout, axis) for axis in inner)


def _flattened(layout: Layout) -> dict[str, tuple[str, ...]]:
    """The flattened axes build_mesh makes for `layout` (each only where it differs from an axis)."""
    axes = layout.mesh_axes()
    replicated, context = "dp_replicate" in axes, "cp" in axes
    made = {"dp": replicated, "dp_shard_cp": context, "dp_cp": replicated and context}
    return {name: FLATTENED[name] for name, wanted in made.items() if wanted}


def mesh_groups(layout: Layout) -> list[Group]:
    """Every group this rank belongs to, size 1 and world-sized ones included, one per mesh axis,
    flattened axis and (ep > 1: parallel/mesh.expert_mesh) expert axis, in that order."""
    return list(_mesh_groups(layout))


@functools.lru_cache(maxsize=4096)
def _mesh_groups(layout: Layout) -> tuple[Group, ...]:
    """mesh_groups, once per Layout (frozen; the planner asks for each candidate's many times)."""
    groups = [Group(axis, size, _stride(layout, (axis,)), (axis,)) for axis, size in layout.mesh_axes().items()]
    groups += [Group(name, math.prod(getattr(layout, a) for a in axes), _stride(layout, axes), axes)
               for name, axes in _flattened(layout).items()]
    if layout.ep > 1:  # ep consecutive ranks of the shard ranks (dp_shard x cp, stride tp); edp across them
        shards = layout.dp_shard * layout.cp
        groups += [Group("edp", shards // layout.ep, layout.tp * layout.ep, ("edp",)),
                   Group("ep", layout.ep, layout.tp, ("ep",))]
    return tuple(groups)


def process_groups(layout: Layout) -> list[Group]:
    """The distinct process groups of more than one rank this rank belongs to: the default group
    ("world", when the world has more than one rank; every world-sized axis is it), then each other
    mesh_groups entry of size > 1. Equal on every rank."""
    world = [_world(layout)] if layout.world_size > 1 else []
    return world + [g for g in mesh_groups(layout) if 1 < g.size < layout.world_size]


def _world(layout: Layout) -> Group:
    return Group("world", layout.world_size, 1, AXES)


def group_of(layout: Layout, axes: tuple[str, ...]) -> Group:
    """The group a collective over mesh `axes` runs on: the one of mesh_groups over the same axes of
    the mesh (its size-1 axes left out, dp_shard kept: mesh.py's ddp_mesh, for one, takes "dp_cp",
    "dp_shard_cp", "dp" or "dp_shard" by which axes are there), or the default group ("world") when
    the axes span every rank (the trainer's own all-reduces; any axis of the world's size)."""
    present = {*layout.mesh_axes(), "edp", "ep"}
    wanted = [axis for axis in axes if axis in present]
    if all(axis in axes for axis in layout.mesh_axes()):
        return _world(layout)
    for group in mesh_groups(layout):
        if [axis for axis in group.axes if axis in present] == wanted:
            return _world(layout) if group.size == layout.world_size else group
    raise ValueError(f"no process group over {axes} in {layout.mesh_axes()}")
