"""Data parallelism: DDP, ZeRO-1/2/3 and HSDP, with CPU offload, built on PyTorch's own pieces.

- zero_stage 0, DDP (`replicate`, composable DDP): each rank keeps whole parameters, gradients
  and optimizer states; gradients are all-reduced.
- zero_stage 1 (`replicate` + `ZeroRedundancyOptimizer`): whole parameters and gradients; each
  rank steps the states of its own parameters only, then broadcasts the updated parameters.
- zero_stage 2 (`fully_shard(reshard_after_forward=False)`): parameter, gradient and optimizer
  shards; parameters are all-gathered once per step and kept whole from forward to backward,
  gradients reduce-scattered.
- zero_stage 3 (`fully_shard` per block, then the root): shards only; each block's parameters are
  all-gathered before its forward and again before its backward, and freed after each.

DDP is composable `replicate` rather than the DistributedDataParallel wrapper because it is
applied in place and builds its DDP lazily at the first forward: it can be applied to the
meta-device model like fully_shard, and state-dict keys carry no "module." prefix.

HSDP is stage 2 or 3 on a 2-D mesh (dp_replicate x dp_shard): sharded within a dp_shard group,
replicated across groups (reduce-scatter, then an all-reduce of the shards across replicas).

Why ZeRO-1 is ZeroRedundancyOptimizer and not FSDP2: every FSDP2 layout reduce-scatters the
gradients, so an FSDP2 "ZeRO-1" would shard the gradients too and be ZeRO-2 under another name.
ZeroRedundancyOptimizer over DDP is the textbook stage 1 (full gradients from one all-reduce,
states of ~1/dp of the parameters per rank, a broadcast of the updated parameters); it assigns
whole parameters to ranks, so its split is balanced only to a parameter's size. The checkpoint
code saves its local optimizer in the same per-parameter form as every other layout.

CPU offload (memory.offload) is FSDP2's CPUOffloadPolicy: the sharded parameters live in host
memory, their gradients are copied there after the reduce-scatter, and the optimizer steps there,
so its states are host memory too. FSDP2 cannot separate "optimizer states on the host" from
"sharded parameters on the host": the optimizer updates the sharded parameters in place, so they
move together. What the two settings do separate is how long the unsharded parameters stay on
the device: "optimizer" (ZeRO-Offload; zero_stage 2 or 3) keeps them as the stage says,
"optimizer+params" (zero_stage 3 only) frees them after each block's forward and backward.

Mixed precision under FSDP2 is its MixedPrecisionPolicy (bf16-mixed: all-gather and compute in
bf16, reduce gradients in fp32, fp32 sharded master weights; fp16-mixed the same in fp16, with a
ShardedGradScaler whose inf check is all-reduced so every rank skips the same steps); autocast is
then off. DDP and ZeRO-1 keep the single-device form (fp32 parameters, autocast).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from trainfit.precision import PrecisionPolicy


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate `model` over the 1-D data-parallel mesh (DDP, set up lazily at the first forward,
    so it can be applied to a meta-device model that is materialized afterwards)."""
    # Buffers (RoPE tables) never change: synced once at the first forward, not at every one.
    # gradient_as_bucket_view: replicate passes it on to DistributedDataParallel, whose gradients
    # then are views into its all-reduce buckets instead of one more copy of every gradient.
    return replicate(model, device_mesh=dp_mesh, forward_sync_buffers=False, gradient_as_bucket_view=True)


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """*-mixed: compute copies in the low dtype, fp32 gradient reduction (and fp32 master shards).
    fp32 and bf16-pure: everything in the parameters' own dtype."""
    if policy.keeps_master_weights:
        return MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool, offload: bool) -> nn.Module:
    """fully_shard every block of `model.layers`, then the root (embeddings, final norm, output:
    one group, so a tied embedding/output weight stays one parameter).

    With reshard_after_forward, each block also prefetches explicitly: the next block's all-gather
    is issued when a block starts its forward, the previous block's when it starts its backward.
    """
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    options = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload_policy}
    blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    # The root's parameters are needed again as soon as backward starts: never reshard them.
    fully_shard(model, reshard_after_forward=False, **options)
    if reshard_after_forward:
        for block, following in zip(blocks, blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([block])
    return model


def shard_optimizer_states(optimizer: torch.optim.Optimizer, group: torch.distributed.ProcessGroup
                           ) -> ZeroRedundancyOptimizer:
    """ZeRO-1: the same optimizer (class, parameter groups, hyperparameters) with its states
    split across the ranks of `group`."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=group, **defaults)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states (ZeRO-1's local one, else `optimizer` itself)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def is_fully_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def grad_scaler(policy: PrecisionPolicy, *, sharded: bool) -> torch.amp.GradScaler:
    """fp16 loss scaling; on sharded gradients the inf/nan check is all-reduced, so that a step is
    skipped on every rank or on none (each rank sees only its own shard)."""
    if sharded and policy.uses_loss_scaling:
        return ShardedGradScaler(policy.device_type)
    return policy.make_grad_scaler()


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Gradient accumulation: call with sync=False for every micro-batch but the last.

    DDP (zero 0/1) then skips the all-reduce and accumulates locally. FSDP still reduce-scatters
    every micro-batch (keeping only gradient shards is what ZeRO-2/3 are for); under HSDP only the
    all-reduce across replicas waits for the last micro-batch.
    """
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(sync)
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, correct on sharded gradients too: the norm of DTensor gradients is
    a partial result that is reduced across the shards before clipping (DDP's are already whole)."""
    params = [p for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    # Keyed by address: FSDP2's gradient shards are views into one reduce-scatter buffer.
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[local.data_ptr() or id(local)] = local.numel() * local.element_size()
    return sum(seen.values())


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the model states this rank holds (its shards; shared tensors counted once):
    params, grads (as they are now: call between backward and the optimizer step) and optimizer."""
    params = list(model.parameters())
    states = local_optimizer(optimizer).state.values()
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _local_bytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor)),
    }

