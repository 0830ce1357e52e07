"""Layouts in a fake world (the `fake` backend: real FSDP2 / DDP code, no data): the mesh a Layout
builds and what parallelize does to a meta-device model. Validation is tests/unit/test_layout.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from _dist import DP_BATCH, fake_world
from _runs import run_config
from trainfit.parallel.apply import parallelize
from trainfit.parallel.layout import build_layout
from trainfit.parallel.mesh import build_mesh, dp_mesh, fsdp_mesh
from trainfit.precision import precision_policy


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
