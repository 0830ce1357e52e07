"""Layouts in a fake world (the `fake` backend: real FSDP2 / DDP code, no data): the mesh a Layout
builds and what parallelize does to a meta-device model. Validation is tests/unit/test_layout.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from _dist import DP_BATCH, fake_world
from _runs import run_config
from trainfit.parallel.mesh import build_mesh, dp_mesh, fsdp_mesh
from trainfit.parallel.resolve import build_layout
from trainfit.precision import precision_policy
from trainfit.train.parallelize import parallelize


def test_mesh_axes_follow_the_degrees(tmp_path) -> None:
    hsdp = build_layout(run_config(tmp_path, *DP_BATCH, "--hardware.num_gpus=8", "--parallel.dp_replicate=2",
                                   "--parallel.zero_stage=3", "--training.micro_batch_size=1"))
    assert hsdp.mesh_axes() == {"dp_replicate": 2, "dp_shard": 4}
    assert build_layout(run_config(tmp_path, *DP_BATCH)).mesh_axes() == {"dp_shard": 1}
    with fake_world(8, rank=5):
        mesh = build_mesh(hsdp, "cpu")
        assert fsdp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard")
        assert (dp_mesh(mesh).size(), dp_mesh(mesh).get_local_rank()) == (8, 5)


@pytest.mark.parametrize("stage", [2, 3])
def test_fully_shard_groups_blocks_then_root_and_keeps_ties(tmp_path, stage: int) -> None:
    from trainfit.models import build_model

    cfg = run_config(tmp_path, *DP_BATCH, "--model.preset=debug-gpt2", "--hardware.num_gpus=4",
                     "--training.micro_batch_size=1",
                     f"--parallel.zero_stage={stage}", "--memory.offload=optimizer",
                     "--memory.activation_checkpointing=full", "--precision.mode=bf16-mixed")
    layout = build_layout(cfg)
    with fake_world(4):
        model = build_model(cfg.model)
        parallelize(model, layout, build_mesh(layout, "cpu"), precision_policy(cfg.precision.mode, "cpu"))
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
        assert model.output.weight is model.tok_embeddings.weight  # one parameter, in the root's group
        block = model.layers[0]._get_fsdp_state()._fsdp_param_group
        assert (block.post_forward_mesh_info is not None) == (stage == 3)  # reshard after forward
        assert isinstance(block.offload_policy, CPUOffloadPolicy)
        assert block.mp_policy.param_dtype == torch.bfloat16 and block.mp_policy.reduce_dtype == torch.float32
        assert hasattr(model.layers[0], "_checkpoint_wrapped_module")  # AC first, then FSDP around it


def test_expert_parallel_splits_the_experts_over_consecutive_ranks(tmp_path) -> None:
    """ep2 on 4 ranks (dp_shard=4): expert groups {0, 1} and {2, 3}; rank 2 holds experts 0-1 of 4
    (ep) and, of those, FSDP2 keeps expert 1 on it (edp {0, 2}); the names stay the model's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from trainfit.models import build_model

    cfg = run_config(tmp_path, *DP_BATCH, "--model.preset=debug-moe", "--hardware.num_gpus=4",
                     "--training.micro_batch_size=2", "--parallel.zero_stage=3", "--parallel.ep=2")
    layout = build_layout(cfg)
    with fake_world(4, rank=2):
        model = build_model(cfg.model)
        parallelize(model, layout, build_mesh(layout, "cpu"), precision_policy(cfg.precision.mode, "cpu"))
        w1 = dict(model.named_parameters())["layers.0.feed_forward.experts.w1"]
        assert isinstance(w1, DTensor) and w1.shape == (4, 64, 64) and w1.to_local().shape == (1, 64, 64)
        edp, ep = w1.device_mesh.mesh_dim_names
        assert (edp, ep) == ("edp", "ep")
        assert dist.get_process_group_ranks(w1.device_mesh.get_group("ep")) == [2, 3]
        assert dist.get_process_group_ranks(w1.device_mesh.get_group("edp")) == [0, 2]
        assert compute_local_shape_and_global_offset(w1.shape, w1.device_mesh, w1.placements)[1][0] == 1
        router = dict(model.named_parameters())["layers.0.feed_forward.router.weight"]
        assert router.device_mesh.mesh_dim_names == ("dp_shard",)  # dense: over every rank
