"""parallel/groups.py's count of the process groups a rank belongs to, against the groups torch
creates for the real mesh (gloo, 4 ranks): memory/closed_form/comm_buffers.py prices one set of NCCL buffers
per group, so the count is the estimate's multiplier."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group, _world

from _dist import FourRankGlooTestCase, with_comms
from trainfit.configure import load_config
from trainfit.parallel.collectives import REPLICAS, SHARD
from trainfit.parallel.groups import FLATTENED, group_of, mesh_groups, process_groups
from trainfit.parallel.mesh import build_mesh, ddp_mesh, expert_mesh, shard_mesh
from trainfit.parallel.resolve import build_layout

LAYOUTS = [
    ("--parallel.tp=2", "--parallel.zero_stage=3"),  # dp_shard=2 x tp=2
    ("--parallel.pp=2", "--parallel.zero_stage=3"),  # pp=2 x dp_shard=2
    ("--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.zero_stage=3"),  # all flattened; dp_cp the world
    ("--parallel.dp_replicate=2", "--parallel.tp=2"),  # DDP: "dp" and "dp_replicate" over the same ranks
    ("--model.preset=debug-moe", "--parallel.ep=2", "--parallel.zero_stage=3"),  # dp_shard the world; edp, ep
]


class ProcessGroupsOnFourRanks(FourRankGlooTestCase):
    @with_comms
    def test_the_count_is_the_groups_torch_creates_for_the_mesh(self) -> None:
        self.run_subtests({"overrides": LAYOUTS}, self._check)

    def _check(self, overrides: tuple[str, ...]) -> None:
        cfg = load_config(None, ["--model.preset=debug", "--hardware.num_gpus=4", "--training.global_batch_size=0",
                                 *overrides])
        layout = build_layout(cfg)
        before = set(_world.pg_map)
        mesh = build_mesh(layout, "cpu")
        sparse = expert_mesh(mesh, layout) if layout.ep > 1 else None
        # What torch registered on this rank: the groups it is a member of (new_group registers no other).
        created = [pg for pg in _world.pg_map if pg not in before]

        def torch_group(name: str) -> dist.ProcessGroup:
            if name in ("edp", "ep"):
                assert sparse is not None
                return sparse[name].get_group()
            return mesh[name].get_group() if name in FLATTENED else mesh.get_group(name)

        default = _get_default_group()
        for group in mesh_groups(layout):
            pg = torch_group(group.name)
            ranks = dist.get_process_group_ranks(pg)
            assert len(ranks) == group.size, (overrides, group)
            spaced = list(range(ranks[0], ranks[0] + group.size * group.stride, group.stride))
            assert ranks == spaced, (overrides, group)
            assert (pg is default) == (group.size == layout.world_size), (overrides, group)  # reused, not new
        groups = process_groups(layout)
        distinct = {torch_group(g.name) for g in mesh_groups(layout) if g.size > 1} | {default}
        assert len(groups) == len(distinct), (overrides, groups)
        # Every group torch created for the mesh, size 1 ones aside, and the default group it reused.
        assert len(groups) == 1 + sum(pg.size() > 1 for pg in created), (overrides, groups)
        # A collective over data-parallel axes (parallel/collectives.py) runs on the group mesh.py gives
        # the engine: memory/closed_form/comm_buffers.py counts that one, not its twins over the same ranks.
        def over(axes: tuple[str, ...]) -> dist.ProcessGroup:
            group = group_of(layout, axes)
            return default if group.name == "world" else torch_group(group.name)

        assert over(("dp_replicate", "dp_shard", "cp")) is ddp_mesh(mesh).get_group(), overrides
        assert over(SHARD) is shard_mesh(mesh).get_group(), overrides
        if layout.dp_replicate > 1:
            assert over(REPLICAS) is mesh.get_group("dp_replicate"), overrides
