"""Data parallelism: DDP, ZeRO-1/2/3 and HSDP, with CPU offload, built on PyTorch's own pieces.

Model states per rank (Ψ parameters, N = dp_shard ranks, AdamW; *-mixed = bf16/fp16 compute with
fp32 masters), the forms memory/closed_form/analytic.py follows:

| zero_stage | engine                                      | *-mixed                    | fp32          |
| ---------- | ------------------------------------------- | -------------------------- | ------------- |
| 0 (DDP)    | `replicate`, gradients in its buckets       | 16Ψ (+ autocast's copies)  | 16Ψ           |
| 1          | parallel/zero.py's ZeroOptimizer            | 4Ψ + 12Ψ/N (the paper's);  | 8Ψ + 8Ψ/N     |
|            |                                             | 6Ψ + 12Ψ/N with fp32 grads |               |
|            |                                             | (bf16-pure: 4Ψ + 4Ψ/N)     |               |
| 2          | `fully_shard(reshard_after_forward=False)`  | 2Ψ + 16Ψ/N (fwd to bwd)    | 4Ψ + 16Ψ/N    |
| 3          | `fully_shard` per block, then the root      | 16Ψ/N (+ gathered blocks)  | 16Ψ/N         |

- zero_stage 0, DDP (`replicate`, composable DDP): each rank keeps whole parameters, gradients
  and optimizer states; gradients are all-reduced in buckets, which are the gradients
  (gradient_as_bucket_view: `.grad` is a view of its bucket, no second copy).
- zero_stage 1 (ZeroOptimizer, no wrapper; the paper's P_os, DeepSpeed's stage 1, Megatron's
  distributed optimizer): parameters in the compute dtype, whole on every rank; gradients
  accumulate in flat per-bucket buffers (in the parameters' dtype, or fp32 with
  optimizer.grad_accum_dtype='fp32': Megatron's main grads) and are reduce-scattered once per
  step; master weights and optimizer states exist for this rank's 1/N only; the updated shards
  are all-gathered into the parameters. Under HSDP the shards are also all-reduced across the
  dp_replicate replicas.
- zero_stage 2 (`fully_shard(reshard_after_forward=False)`): parameter, gradient and optimizer
  shards; parameters are all-gathered once per step and kept whole from forward to backward,
  gradients reduce-scattered (in fp32 under *-mixed: 4Ψ/N where the paper has 2Ψ/N).
- zero_stage 3 (`fully_shard` per block, then the root): shards only; each block's parameters are
  all-gathered before its forward and again before its backward, and freed after each.

DDP is composable `replicate` rather than the DistributedDataParallel wrapper because it is
applied in place and builds its DDP lazily at the first forward: it can be applied to the
meta-device model like fully_shard, and state-dict keys carry no "module." prefix.

HSDP is a ZeRO stage on a 2-D mesh (dp_replicate x dp_shard): sharded within a dp_shard group,
replicated across groups (reduce-scatter, then an all-reduce of the shards across replicas).

Expert parallelism (parallel/expert.py) composes with FSDP2 (zero_stage 2, 3, offload) only: the
routed experts are DTensors split over an expert group before data parallelism sees them, and
their gradients are reduced over the other groups (edp) with a divide factor of their own
(ExpertShards). DDP and the ZeRO-1 engine take plain tensors and one reduction group: refused by
Layout.untrainable_reason.

Why ZeRO-1 is its own engine and not FSDP2: every FSDP2 layout reduce-scatters the gradients
during backward and keeps only shards, so an FSDP2 "ZeRO-1" would be ZeRO-2 under another name.
ZeRO-1's gradients are whole until the step; its point is the 1/N masters and states.

Precision under ZeRO-1: fp32 trains fp32 parameters, the masters are their own rows (views);
*-mixed casts the parameters to the 16-bit dtype once the fp32 masters are taken from the
initialized weights, and the model computes in it with autocast off (as FSDP2's
MixedPrecisionPolicy does; fp16 adds a ShardedGradScaler over the shard group); bf16-pure keeps
its bf16 parameters and steps their own rows with bf16 optimizer states (no fp32 copy anywhere,
as on one rank).

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
then off. DDP keeps the single-device form (fp32 parameters, autocast).

The trainer reaches the engines through the functions below only (reduce_gradients,
clip_grad_norm_, set_gradient_sync, grad_scaler, state_dicts / load_state_dicts,
model_state_tensors / local_state_bytes), never by testing which engine it has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, Shard

from trainfit.models.nf4 import is_nf4
from trainfit.parallel.engine import (
    DDP_BUCKET_BYTES,
    DDP_GRADIENT_AS_BUCKET_VIEW,
    FSDP_PREFETCH_BLOCKS,
    FSDP_REDUCE_BYTES_MIXED,
)
from trainfit.parallel.zero import ZeroOptimizer, plain_tensors
from trainfit.precision import PrecisionPolicy

STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
"""Checkpoints keep the optimizer flattened per parameter (`state.<fqn>.exp_avg`,
`param_groups.<fqn>.lr`): the same keys whatever the layout (train/checkpoint.py)."""
GRAD_ACCUM_DTYPES = {"fp32": torch.float32}
"""optimizer.grad_accum_dtype -> ZeroOptimizer's grad_dtype ("param": None, the parameters' dtype)."""


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicate `model` over the 1-D data-parallel mesh (DDP, set up lazily at the first forward,
    so it can be applied to a meta-device model that is materialized afterwards)."""
    # QLoRA: no first broadcast of the parameters, which would concatenate the NF4 weights (that
    # dequantizes them) and copy the result back (that quantizes again, to other values); every rank
    # holds the same parameters already (models/init.py, peft/nf4.py).
    quantized = any(is_nf4(param) for param in model.parameters())
    # Buffers (RoPE tables) never change: synced once at the first forward, not at every one.
    # gradient_as_bucket_view: replicate passes it on to DistributedDataParallel, whose gradients
    # then are views into its all-reduce buckets instead of one more copy of every gradient.
    return replicate(model, device_mesh=dp_mesh, forward_sync_buffers=False,
                     gradient_as_bucket_view=DDP_GRADIENT_AS_BUCKET_VIEW, bucket_cap_mb=DDP_BUCKET_BYTES / 2**20,
                     init_sync=not quantized)


def mixed_precision_policy(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """*-mixed: compute copies in the low dtype, fp32 gradient reduction (and fp32 master shards).
    fp32 and bf16-pure: everything in the parameters' own dtype."""
    if policy.keeps_master_weights:
        reduce = {4: torch.float32, 2: policy.autocast_dtype}[FSDP_REDUCE_BYTES_MIXED]
        return MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=reduce)
    return MixedPrecisionPolicy()


@dataclass(frozen=True)
class ExpertShards:
    """Expert parallelism's routed-expert weights (parallel/expert.py): in their block's FSDP2 unit,
    but sharded over the edp ranks (`mesh`), a parameter group of their own. Their gradients already
    sum the tokens of a whole expert group, so their block's reduction divides by `divide_factor`,
    every rank whose mean loss the step averages (dp_shard x cp), where FSDP2 would divide the
    experts' by the edp ranks (the dense weights' group is that large: the same factor)."""

    params: frozenset[nn.Parameter]
    mesh: DeviceMesh
    divide_factor: int

    def placement_fn(self) -> Callable[[nn.Parameter], Any]:
        """fully_shard's shard_placement_fn: the experts' weights on `mesh`, the others as given.
        Private (torch 2.13's per-parameter mesh; torchtitan uses it so): an API move breaks here."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

        on_mesh = ShardPlacementResult(Shard(0), FSDPMeshInfo(self.mesh, shard_mesh_dim=0))
        return lambda param: on_mesh if param in self.params else None


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, mp_policy: MixedPrecisionPolicy,
               reshard_after_forward: bool, offload: bool, experts: ExpertShards | None = None) -> nn.Module:
    """fully_shard every block of `model.layers`, then the root (embeddings, final norm, output:
    one group, so a tied embedding/output weight stays one parameter). Under expert parallelism a
    block's routed experts are sharded on their own mesh (ExpertShards), within the block's unit:
    one unit per block, whose hooks stay outside activation checkpointing's region.

    With reshard_after_forward, each block also prefetches explicitly: the next block's all-gather
    is issued when a block starts its forward, the previous block's when it starts its backward.
    """
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    options = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload_policy}
    placement = experts.placement_fn() if experts is not None else None
    blocks = list(model.layers)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement, **options)
        if experts is not None:
            block.set_gradient_divide_factor(experts.divide_factor)
            # A plain sum, then the division: gloo has no pre-multiplied sum (FSDP2's way to divide
            # by a factor other than the group's size). Not on one edp rank, where FSDP2 (torch
            # 2.13) would divide twice: in place of the reduce-scatter, and after it.
            block.set_force_sum_reduction_for_comms(experts.mesh.size() > 1)
    # The root's parameters are needed again as soon as backward starts: never reshard them.
    fully_shard(model, reshard_after_forward=False, **options)
    if reshard_after_forward:
        ahead = FSDP_PREFETCH_BLOCKS
        for i, block in enumerate(blocks):
            if blocks[i + 1:i + 1 + ahead]:
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + ahead])
            if blocks[max(0, i - ahead):i]:
                block.set_modules_to_backward_prefetch(blocks[max(0, i - ahead):i][::-1])
    return model


def apply_zero1(model: nn.Module, param_groups: list[dict[str, Any]],
                make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], shard_mesh: DeviceMesh,
                policy: PrecisionPolicy, *, grad_accum_dtype: str = "param",
                replicate_group: torch.distributed.ProcessGroup | None = None) -> ZeroOptimizer:
    """ZeRO-1 over the 1-D `shard_mesh` for a materialized (fp32, or bf16-pure's bf16) model: the
    optimizer `make_optimizer` builds, over this rank's master shards of `param_groups`. Casts the
    parameters to the compute dtype under *-mixed (the module docstring's precision paragraph)."""
    mixed = policy.keeps_master_weights
    return ZeroOptimizer(model, param_groups, make_optimizer, shard_mesh,
                         param_dtype=policy.autocast_dtype if mixed else None,
                         master_dtype=torch.float32 if mixed else policy.param_dtype,
                         grad_dtype=GRAD_ACCUM_DTYPES.get(grad_accum_dtype), replicate_group=replicate_group)


def is_fully_sharded(model: nn.Module) -> bool:
    """FSDP2 holds the model's parameters (a pipeline rank's StageParts: its stages' blocks)."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def grad_scaler(policy: PrecisionPolicy, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                pipelined: bool = False) -> torch.amp.GradScaler:
    """fp16 loss scaling; on sharded gradients (FSDP, ZeRO-1's shards, a pipeline stage's) the
    inf/nan check is all-reduced, so that a step is skipped on every rank or on none (each rank sees
    only its shard or stage)."""
    if not policy.uses_loss_scaling:
        return policy.make_grad_scaler()
    if isinstance(optimizer, ZeroOptimizer):
        return ShardedGradScaler(policy.device_type, process_group=optimizer.group)
    if is_fully_sharded(model) or pipelined:  # over the whole world
        return ShardedGradScaler(policy.device_type)
    return policy.make_grad_scaler()


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Gradient accumulation: call with sync=False for every micro-batch but the last.

    DDP (zero 0) then skips the all-reduce and accumulates locally. FSDP still reduce-scatters
    every micro-batch (keeping only gradient shards is what ZeRO-2/3 are for); under HSDP only the
    all-reduce across replicas waits for the last micro-batch. ZeRO-1 communicates nothing in
    backward (reduce_gradients does, once per step).
    """
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(sync)
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Once per step, after the last micro-batch's backward: ZeRO-1's reduce-scatter of the
    accumulated gradients (every other engine reduced them during backward)."""
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.reduce_gradients()


def clip_grad_norm_(model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float,
                    pp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    """torch's clip_grad_norm_ over the gradients the optimizer steps on, correct on sharded ones
    too: the norm of DTensor gradients is a partial result that is reduced across the shards before
    clipping (DDP's are already whole); ZeRO-1 clips its master shards' gradients (one all-reduce).
    `pp_group`: the pipeline ranks, each holding other stages' gradients; the global norm sums their
    squared norms (one more all-reduce)."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.clip_grad_norm_(max_norm)
    groups = group_by_layout([p for p in model.parameters() if p.grad is not None])
    norms = []
    for members in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in members])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total_norm = norms[0]
    else:
        total_norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.nn.utils.get_total_norm([])
    if pp_group is not None:
        squared = total_norm.float() ** 2
        torch.distributed.all_reduce(squared, group=pp_group)
        total_norm = squared.sqrt()
    for members in groups:  # each group's norm is reduced on its own, then the norms are combined
        torch.nn.utils.clip_grads_with_norm_(members, max_norm, total_norm)
    return total_norm


def group_by_layout(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` grouped by how they are laid out: plain tensors, and DTensors of each mesh and
    placements. Tensor parallelism mixes them (tp-sharded weights, replicated norm gains, FSDP
    shards of either, parameters no plan touches), and torch's foreach kernels (the optimizer's,
    gradient clipping's) take one kind at a time."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def init_optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the states an optimizer makes lazily, leaving the weights as they are: one step on
    zero gradients (ZeRO-1: at learning rate 0, on its master shards)."""
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.init_states()
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- checkpoints


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts in the one checkpoint form of every layout: keyed by parameter
    name, the optimizer flattened (STATE_DICT_OPTIONS), sharded tensors as DTensors; ZeRO-1 gives
    its master weights under the parameters' names. dcp.load fills them in place. A rank that holds no
    parameter (a pipeline rank whose stages have no blocks, nor the embedding or the head) gives two empty
    ones: DCP's get_state_dict refuses an empty model, yet dcp.save and dcp.load are collective, so that
    rank still enters them, with nothing of its own."""
    if isinstance(optimizer, ZeroOptimizer):
        return optimizer.model_state_dict(), optimizer.optimizer_state_dict(flatten=True)
    if next(model.parameters(), None) is None:
        return {}, {}
    return get_state_dict(model, optimizer, options=state_dict_options(model))


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                     optimizer_state: dict[str, Any]) -> None:
    """Set model and optimizer from state_dicts' form (collective under ZeRO-1: the parameters are
    all-gathered from the loaded masters)."""
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_model_state_dict(model_state)
        optimizer.load_optimizer_state_dict(optimizer_state)
        return
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=state_dict_options(model))


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """STATE_DICT_OPTIONS; with frozen parameters (PEFT's base), without them: a checkpoint holds what
    trains, the base comes from where the run started (model.init_from, or the seed)."""
    if all(p.requires_grad for p in model.parameters()):
        return STATE_DICT_OPTIONS
    return dataclasses.replace(STATE_DICT_OPTIONS, ignore_frozen_params=True, strict=False)


# ---------------------------------------------------------------- accounting


def model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer,
                        policy: PrecisionPolicy) -> dict[str, list[torch.Tensor]]:
    """This rank's model-state tensors by memory component (memory/breakdown.py's names), each
    storage in one component: what memory/traced/ledger.py tags and local_state_bytes counts. ZeRO-1's
    flat gradient buffers and its master shards' gradients are grads; its replicated compute-dtype
    parameters params, its master shards master_params (memory/closed_form/analytic.py's forms). Elsewhere the
    parameters are the masters under *-mixed (fp32, autocast casts them per op)."""
    if isinstance(optimizer, ZeroOptimizer):
        tensors = optimizer.state_tensors()
        return {"params": tensors["params"], "master_params": tensors["master_params"],
                "grads": tensors["grads"] + tensors["master_grads"], "optimizer": tensors["optimizer"]}
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"master_params" if policy.keeps_master_weights else "params": params,
            "grads": [p.grad for p in params if p.grad is not None], "optimizer": states}


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    # Keyed by where each tensor starts (FSDP2's gradient shards are views into one reduce-scatter
    # buffer); by storage object, not address: fake tensors (the traced step) have none.
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        for local in plain_tensors(t.to_local() if isinstance(t, DTensor) else t):
            seen[id(local.untyped_storage()), local.storage_offset()] = local.numel() * local.element_size()
    return sum(seen.values())



def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the model states this rank holds (its shards; shared storages counted once):
    params, grads (as they are now: call between backward and the optimizer step) and optimizer;
    under ZeRO-1 also master_params (its grads: the flat buffers and the master gradients)."""
    if isinstance(optimizer, ZeroOptimizer):
        counts = optimizer.state_bytes()
        return {"params": counts["params"], "master_params": counts["master_params"],
                "grads": counts["grads"] + counts["master_grads"], "optimizer": counts["optimizer"]}
    params = list(model.parameters())
    states = optimizer.state.values()
    return {
        "params": _local_bytes(params),
        "grads": _local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _local_bytes(v for s in states for v in s.values() if isinstance(v, torch.Tensor)),
    }
