"""Layout -> parallel model: the one place where parallelism is applied (the trainer and the traced
estimator both call it, so the prediction and the run cannot drift apart)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh

from trainfit.models.common import set_sequence_layout
from trainfit.parallel import data_parallel as dp
from trainfit.parallel.context_parallel import ContextParallel
from trainfit.parallel.expert import apply_expert_parallel
from trainfit.parallel.layout import Layout
from trainfit.parallel.mesh import ddp_mesh, expert_mesh, fsdp_mesh, shard_mesh
from trainfit.parallel.pipeline import StageParts, split_stages
from trainfit.parallel.stage_split import checkpointed
from trainfit.parallel.tensor_parallel import apply_tensor_parallel, enable_async_tp, recompute_gathers
from trainfit.precision import PrecisionPolicy
from trainfit.recompute import apply_activation_checkpointing


def parallelize(model: nn.Module, layout: Layout, mesh: DeviceMesh | None, policy: PrecisionPolicy) -> nn.Module:
    """The model this rank trains: `model` parallelized in place, or under pipeline parallelism the
    StageParts of this rank's stages (parallel/pipeline.py), each cut from `model` and parallelized
    as a model of its own (an FSDP root each, as torchtitan's model parts).

    Applies, in this order, to `model` on the meta device, already in its parameter dtype
    (PrecisionPolicy.prepare_model); the caller then materializes it (to_empty + init_weights):

    0. fp8-mixed: torchao float8 linears (float8.py), first, as torchtitan converts before
       parallelizing: FSDP2 then shards (and with precision.fp8_all_gather gathers in fp8) the
       float8 weights; the output projection stays bf16.
    1. tensor and sequence parallelism (tensor_parallel.py) on the mesh's tp axis: the blocks' own
       parameters become DTensors; context parallelism (context_parallel.py) on the cp axis: the
       model's positions and attention become its rank's chunks' and all-gather K and V; expert
       parallelism (expert.py) on the ep axis of expert_mesh: the routed experts become DTensors
       split over the expert group, and their tokens travel by all-to-all.
    2. activation checkpointing per block (recompute.py), before data parallelism, as in
       torchtitan: fully_shard then wraps the checkpointed block, so its all-gather runs once,
       before the recomputed forward, and nothing is all-gathered again inside recomputation.
    3. torch.compile per block (`compile_blocks`), when layout.compile: after checkpointing, so
       that dynamo traces the checkpoint and inductor's partitioner sees its policy (what to save,
       what to recompute) in the joint graph; before data parallelism, so that FSDP's hooks sit on
       the compiled module and run outside the graph (torchtitan's order).
    4. data parallelism (data_parallel.py): DDP for zero_stage 0; fully_shard per block then root
       for 2, 3 and CPU offload, on a 2-D mesh under HSDP (dp_replicate > 1). ZeRO-1 wraps nothing:
       its engine is the optimizer (`parallelize_optimizer`), built once the model is materialized.
       Each spans the cp ranks too (mesh.py): they shard the states and average the gradients.
       Under expert parallelism (FSDP2 only: Layout.untrainable_reason) the routed experts are
       sharded over expert_mesh's edp axis (data_parallel.ExpertShards).
    """
    if layout.pp > 1:
        assert mesh is not None
        stages = split_stages(model, layout, mesh["pp"].get_local_rank())
        for stage in stages:
            _parallelize_part(stage, layout, mesh, policy)
        return StageParts(stages)
    return _parallelize_part(model, layout, mesh, policy)


def _parallelize_part(model: nn.Module, layout: Layout, mesh: DeviceMesh | None, policy: PrecisionPolicy
                      ) -> nn.Module:
    if policy.fp8_scaling is not None:
        from trainfit.float8 import convert_to_float8  # torchao: imported by fp8 runs only

        convert_to_float8(model, policy, tokens_per_matmul=layout.micro_batch_tokens)
    if layout.tp > 1:
        assert mesh is not None
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=layout.sequence_parallel)
        if layout.regathers:  # blocks activation checkpointing wraps re-gather (selective) or keep only their input
            wraps = layout.activation_checkpointing != "none"
            recompute_gathers(model, mesh["tp"], lambda i: wraps and checkpointed(i, layout.ac_every_n_layers))
        if layout.async_tp:
            enable_async_tp(mesh["tp"])
        if layout.sequence_parallel and model.tok_embeddings is None:  # a later pipeline stage
            model.input_shards = layout.tp
    if layout.cp > 1:
        assert mesh is not None
        set_sequence_layout(model, ContextParallel(mesh["cp"]))
    experts = None
    if layout.ep > 1:
        assert mesh is not None
        sparse = expert_mesh(mesh, layout)
        modules = apply_expert_parallel(model, sparse["ep"])
        experts = dp.ExpertShards(frozenset(p for m in modules for p in m.parameters()), sparse["edp"],
                                  divide_factor=layout.dp_shard * layout.cp)
    apply_activation_checkpointing(model, layout.activation_checkpointing, layout.ac_every_n_layers)
    model.project_logits = not layout.chunked_loss  # the chunked loss projects the hidden states itself
    if layout.compile:
        compile_blocks(model)
    kind = layout.data_parallel
    if kind == "ddp":
        assert mesh is not None
        dp.apply_ddp(model, ddp_mesh(mesh))
    elif kind == "fsdp":
        assert mesh is not None
        # The zero-bubble schedules' weight-gradient passes need the parameters still unsharded.
        reshard = layout.zero_stage == 3 and not layout.splits_backward
        dp.apply_fsdp(model, fsdp_mesh(mesh), mp_policy=dp.mixed_precision_policy(policy),
                      reshard_after_forward=reshard, offload=layout.offload != "none", experts=experts)
    return model


def compile_blocks(model: nn.Module) -> int:
    """torch.compile each block of `model.layers` in place (inductor, whole graph: a graph break
    inside a block is an error, not a silent fallback); returns how many. Identical blocks share
    one compiled graph (dynamo guards on the code and shapes, not on the parameters' values), so
    the first forward and backward compile once per distinct block, not once per layer. The block
    becomes an OptimizedModule whose `_orig_mod.` level state dicts skip (DCP's get_state_dict,
    models/init.WRAPPER_PREFIXES)."""
    for i, block in model.layers.indexed():
        model.layers[i] = torch.compile(block, fullgraph=True)
        model.layers[i].register_forward_pre_hook(_awaited_inputs)
    return len(model.layers)


class _Awaited(torch.autograd.Function):
    """An AsyncCollectiveTensor's waited local tensor, with its gradient passed through unchanged."""

    @staticmethod
    def forward(ctx: Any, pending: AsyncCollectiveTensor) -> torch.Tensor:
        return pending.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _awaited_inputs(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A compiled block's inputs with each pending collective's result waited for, in eager, before
    the compiled region. Tensor parallelism's embedding returns an AsyncCollectiveTensor (its
    RowwiseParallel output is redistributed with async_op=True) into the first block, and torch
    2.13's AOTAutograd unwraps such an input with `trigger_wait()` into its grad-less inner tensor
    (torch/_functorch/_aot_autograd/frontend_utils.py, pytorch#179849): the compiled block would then
    return no gradient for it, and the embedding's redistribute backward fail on the missing one
    (pytorch#191113 proposes the upstream fix: keep requires_grad when unwrapping)."""
    return tuple(_Awaited.apply(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args)


def parallelize_optimizer(model: nn.Module, param_groups: list[dict[str, Any]],
                          make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], layout: Layout,
                          mesh: DeviceMesh | None, policy: PrecisionPolicy) -> torch.optim.Optimizer:
    """The optimizer of the parallelized, materialized `model`: `make_optimizer(param_groups)`, except
    under ZeRO-1, whose engine (data_parallel.apply_zero1) shards the master weights and states over
    dp_shard, all-reduces across dp_replicate (HSDP) and casts the parameters to the compute dtype."""
    if layout.data_parallel != "zero1":
        return make_optimizer(param_groups)
    assert mesh is not None
    replicas = mesh["dp_replicate"].get_group() if layout.dp_replicate > 1 else None
    return dp.apply_zero1(model, param_groups, make_optimizer, shard_mesh(mesh), policy,
                          grad_accum_dtype=layout.grad_accum_dtype, replicate_group=replicas)
