"""Layouts without processes: validation, the world size from the launcher, and what parallelize
does to a meta-device model in a fake world (the `fake` backend: real FSDP2 / DDP code, no data)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from _dist import fake_world, run_config
from trainfit.config import ConfigError
from trainfit.parallel.apply import check_layout, data_parallel_kind, parallelize
from trainfit.parallel.dims import resolve_parallel_dims
from trainfit.parallel.mesh import build_mesh, dp_mesh, fsdp_mesh, mesh_axes
from trainfit.precision import precision_policy
from trainfit.train.distributed import adopt_world_size, launch_command


@pytest.mark.parametrize(("overrides", "message"), [
    (["--memory.offload=optimizer", "--parallel.zero_stage=1"], "set parallel.zero_stage=2 or 3"),
    (["--memory.offload=optimizer+params", "--parallel.zero_stage=2"], "only under parallel.zero_stage=3"),
    (["--memory.chunked_loss=true"], "memory.chunked_loss=true"),
])
def test_layouts_trainfit_cannot_run_fail_with_the_fix(tmp_path, overrides: list[str], message: str) -> None:
    cfg = run_config(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, resolve_parallel_dims(cfg))


def test_zero_stage_on_one_rank_warns_that_it_has_no_effect(tmp_path) -> None:
    cfg = run_config(tmp_path, "--parallel.zero_stage=3")
    with pytest.warns(UserWarning, match="no effect"):
        check_layout(cfg, resolve_parallel_dims(cfg))
    assert data_parallel_kind(cfg, resolve_parallel_dims(cfg)) == "none"
    offload = run_config(tmp_path, "--parallel.zero_stage=3", "--memory.offload=optimizer+params")
    assert data_parallel_kind(offload, resolve_parallel_dims(offload)) == "fsdp"  # FSDP2 on one rank


def test_the_launchers_world_size_fills_num_gpus(tmp_path) -> None:
    cfg = run_config(tmp_path, "--parallel.zero_stage=3")
    adopt_world_size(cfg, 4)
    assert (cfg.hardware.num_gpus, cfg.parallel.dp_shard, cfg.grad_accum_steps) == (4, 4, 1)
    named = run_config(tmp_path, "--hardware.num_gpus=8", "--training.micro_batch_size=1")
    with pytest.raises(ConfigError, match="the launcher started 2 processes"):
        adopt_world_size(named, 2)
    with pytest.raises(ConfigError, match="torchrun --nproc_per_node=8 -m trainfit"):
        adopt_world_size(named, 1)
    assert launch_command(16, 8).startswith("torchrun --nnodes=2 --nproc_per_node=8")


def test_mesh_axes_follow_the_degrees(tmp_path) -> None:
    hsdp = resolve_parallel_dims(run_config(tmp_path, "--hardware.num_gpus=8", "--parallel.dp_replicate=2",
                                            "--parallel.zero_stage=3", "--training.micro_batch_size=1"))
    assert mesh_axes(hsdp) == {"dp_replicate": 2, "dp_shard": 4}
    assert mesh_axes(resolve_parallel_dims(run_config(tmp_path))) == {"dp_shard": 1}
    with fake_world(8, rank=5):
        mesh = build_mesh(hsdp, "cpu")
        assert fsdp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard")
        assert (dp_mesh(mesh).size(), dp_mesh(mesh).get_local_rank()) == (8, 5)


@pytest.mark.parametrize("stage", [2, 3])
def test_fully_shard_groups_blocks_then_root_and_keeps_ties(tmp_path, stage: int) -> None:
    from trainfit.models import build_model

    cfg = run_config(tmp_path, "--model.preset=debug-gpt2", "--hardware.num_gpus=4", "--training.micro_batch_size=1",
                     f"--parallel.zero_stage={stage}", "--memory.offload=optimizer",
                     "--memory.activation_checkpointing=full", "--precision.mode=bf16-mixed")
    dims = resolve_parallel_dims(cfg)
    with fake_world(4):
        model = build_model(cfg.model)
        parallelize(model, cfg, dims, build_mesh(dims, "cpu"), precision_policy(cfg.precision.mode, "cpu"))
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.layers)
        assert model.output.weight is model.tok_embeddings.weight  # one parameter, in the root's group
        block = model.layers[0]._get_fsdp_state()._fsdp_param_group
        assert (block.post_forward_mesh_info is not None) == (stage == 3)  # reshard after forward
        assert isinstance(block.offload_policy, CPUOffloadPolicy)
        assert block.mp_policy.param_dtype == torch.bfloat16 and block.mp_policy.reduce_dtype == torch.float32
        assert hasattr(model.layers[0], "_checkpoint_wrapped_module")  # AC first, then FSDP around it
