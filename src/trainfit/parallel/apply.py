"""Config -> parallel model: the one place where parallelism is applied (the trainer and the traced
estimator both call it, so the prediction and the run cannot drift apart)."""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainfit.config import Config, ConfigError
from trainfit.parallel import data_parallel as dp
from trainfit.parallel.dims import ParallelDims
from trainfit.parallel.mesh import dp_mesh, fsdp_mesh
from trainfit.precision import PrecisionPolicy
from trainfit.recompute import apply_activation_checkpointing

DataParallel = Literal["none", "ddp", "zero1", "fsdp"]


def data_parallel_kind(cfg: Config, dims: ParallelDims) -> DataParallel:
    """How the data-parallel ranks share the model states (see data_parallel.py's table)."""
    if cfg.memory.offload != "none":
        return "fsdp"  # CPU offload is FSDP2's, on one rank too
    if dims.dp == 1:
        return "none"
    return {0: "ddp", 1: "zero1"}.get(dims.zero_stage, "fsdp")


def check_layout(cfg: Config, dims: ParallelDims) -> None:
    """Reject what `trainfit train` cannot run (ConfigError: field, value, fix); warn when an
    option has no effect. Pure: called before any process group exists."""
    p, m = cfg.parallel, cfg.memory
    for name in ("tp", "pp", "cp", "ep"):
        if getattr(p, name) != 1:
            raise ConfigError(f"parallel.{name}={getattr(p, name)}: `trainfit train` runs data parallelism only "
                              f"for now (`trainfit estimate` knows this layout); set parallel.{name}=1")
    if m.chunked_loss:
        raise ConfigError("memory.chunked_loss=true: not yet supported by `trainfit train`; set it to false")
    if m.offload != "none" and p.zero_stage < 2:
        raise ConfigError(f"memory.offload={m.offload!r}: CPU offload is FSDP2's (CPUOffloadPolicy), which "
                          f"shards gradients; set parallel.zero_stage=2 or 3 (it is {p.zero_stage})")
    if m.offload == "optimizer+params" and p.zero_stage != 3:
        raise ConfigError("memory.offload='optimizer+params': parameters leave the device after each block "
                          "only under parallel.zero_stage=3; set it to 3, or use memory.offload='optimizer' "
                          "(ZeRO-Offload: states on the host, parameters whole on the device during the step)")
    if p.zero_stage and dims.zero_shards == 1 and m.offload == "none":
        warnings.warn(f"parallel.zero_stage={p.zero_stage} has no effect: one data-parallel rank holds "
                      "every shard", stacklevel=2)


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None,
                policy: PrecisionPolicy) -> nn.Module:
    """Apply, in this order, to `model` on the meta device, already in its parameter dtype
    (PrecisionPolicy.prepare_model); the caller then materializes it (to_empty + init_weights):

    1. tensor / sequence parallel, context parallel: not built yet (check_layout refuses them);
       they would come first, changing the blocks' own parameters into DTensors.
    2. activation checkpointing per block (recompute.py), before data parallelism, as in
       torchtitan: fully_shard then wraps the checkpointed block, so its all-gather runs once,
       before the recomputed forward, and nothing is all-gathered again inside recomputation.
    3. torch.compile per block: not built yet.
    4. data parallelism (data_parallel.py): DDP for zero_stage 0 and 1 (ZeRO-1 shards the
       optimizer instead: `parallelize_optimizer`), fully_shard per block then root for 2, 3 and CPU
       offload, on a 2-D mesh under HSDP (dp_replicate > 1).

    Returns the model to train (the same object: every technique here works in place).
    """
    apply_activation_checkpointing(model, cfg.memory.activation_checkpointing, cfg.memory.ac_every_n_layers)
    kind = data_parallel_kind(cfg, dims)
    if kind in ("ddp", "zero1"):
        assert mesh is not None
        dp.apply_ddp(model, dp_mesh(mesh))
    elif kind == "fsdp":
        assert mesh is not None
        reshard = dims.zero_stage == 3
        dp.apply_fsdp(model, fsdp_mesh(mesh), mp_policy=dp.mixed_precision_policy(policy),
                      reshard_after_forward=reshard, offload=cfg.memory.offload != "none")
    return model


def parallelize_optimizer(optimizer: torch.optim.Optimizer, cfg: Config, dims: ParallelDims,
                          mesh: DeviceMesh | None) -> torch.optim.Optimizer:
    """ZeRO-1: split the optimizer states over the dp_shard ranks (replicated across dp_replicate,
    like HSDP); every other layout returns `optimizer` unchanged (FSDP shards its states already)."""
    if data_parallel_kind(cfg, dims) != "zero1":
        return optimizer
    assert mesh is not None
    return dp.shard_optimizer_states(optimizer, mesh["dp_shard"].get_group())
