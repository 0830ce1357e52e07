"""A rank's model states per data-parallel engine: parameters, gradients, master weights and optimizer
states under DDP (ZeRO-0), parallel/zero.py's ZeRO-1 and FSDP2 (ZeRO-2/3, CPU offload), in each precision
(parallel/data_parallel.py's table of model-state forms). What is resident all step long, before the step's
moments add what comes and goes (memory/closed_form/step_peak.py). Torch-free."""

from __future__ import annotations

import math
from typing import NamedTuple

from trainfit.memory.closed_form.block.activation_terms import FP32
from trainfit.memory.closed_form.optimizer_memory import (
    largest_sharded_group,
    matrix_shapes,
    on_zero_shard,
    optimizer_bytes,
    optimizer_step_temporaries,
)
from trainfit.memory.closed_form.rank_layout import LayoutCommon, RankLayout
from trainfit.memory.closed_form.run_shape import Precision, Run
from trainfit.optimizer_spec import PER_TENSOR_OPTIMIZERS
from trainfit.peft.spec import adapter_magnitudes, adapter_matrices, adapter_tensor_sizes


class StageStates(NamedTuple):
    """Everything one rank of a stage holds, before picking the peak moment."""

    lay: RankLayout
    prec: Precision
    params: int
    """Parameters (elements) on the rank before ZeRO sharding."""
    persistent: int
    """Bytes of the parameters the optimizer updates, resident on the device."""
    grads: int
    """Bytes of all resident gradients (ZeRO-1: its flat buffers)."""
    optimizer: int
    optimizer_temp: int
    fsdp: bool
    tokens: int
    seq: int
    compute_params: int = 0
    """ZeRO-1 under *-mixed: the replicated 16-bit parameters beside the fp32 master shards."""
    master_grads: int = 0
    """ZeRO-1: its master shards' gradients in the master dtype, from the reduce-scatter to the end
    of the step, when the buffers hold another dtype (else views of the buffers)."""


def stage_states(run: Run, common: LayoutCommon, lay: RankLayout) -> StageStates:
    prec, fsdp, counts = common.prec, common.fsdp, common.counts
    if run.layout.data_parallel == "zero1":
        return _zero1_stage(run, common, lay)
    offload = run.layout.offload != "none"
    n = lay.summed.params + lay.embedding + lay.head
    no_decay = lay.summed.no_decay + (counts.final_norm if lay.last else 0)
    param_shards = run.layout.zero_shards if fsdp else 1
    state_shards = run.layout.zero_shards if run.layout.zero_stage >= 1 else 1
    experts, ep = lay.summed.experts, run.layout.ep
    resident = 0 if offload else on_zero_shard(n, experts, param_shards, ep) * prec.param
    if lay.summed.nf4 and not offload:  # QLoRA: the base's block linears in NF4, not the parameters' dtype
        resident -= (lay.summed.nf4 * prec.param - lay.summed.nf4_bytes) // param_shards
    matrices = matrix_shapes(run, common, lay, state_shards) if run.optimizer.name in PER_TENSOR_OPTIMIZERS else []
    if lay.trainable >= 0:
        return _adapted_stage(run, common, lay, resident, param_shards, state_shards)
    optimizer = 0 if offload else optimizer_bytes(run.optimizer.name, prec, on_zero_shard(n, experts, state_shards, ep),
                                                   lay.tensors, no_decay // state_shards, matrices)
    temp = 0 if offload else optimizer_step_temporaries(
        run, prec, largest_sharded_group(run, common, lay, n - no_decay, experts, state_shards), lay.largest_tensor,
        matrices)
    return StageStates(lay, prec, n, resident, resident, optimizer, temp, fsdp, common.tokens, common.seq)


def _adapted_stage(run: Run, common: LayoutCommon, lay: RankLayout, resident: int, param_shards: int,
                   state_shards: int) -> StageStates:
    """PEFT (peft/spec.py): every parameter resident, gradients and optimizer states of what trains
    only (the adapters' matrices and DoRA's magnitudes; the embedding or output projection where
    asked). Not ZeRO-1 (Layout.untrainable_reason)."""
    adaptation, prec = run.layout.adaptation, common.prec
    assert adaptation is not None
    offload = run.layout.offload != "none"
    magnitudes = int(common.per_kind(lay, lambda r, _: adapter_magnitudes(r.model, adaptation)))
    full = [(lay.embedding,)] * (adaptation.train_embeddings and lay.embedding > 0) + \
        [(lay.output_matmul,)] * (adaptation.train_output and lay.output_matmul > 0 and not lay.tied_here)
    ep = run.layout.ep
    shapes = [s for kind, blocks in zip(common.kinds, lay.kind_blocks, strict=True)
              for s in blocks * adapter_matrices(kind.run.model, adaptation, ep)] + full
    matrices = [(math.prod(s) // state_shards,) for s in shapes] if run.optimizer.name in PER_TENSOR_OPTIMIZERS else []
    # a routed weight's stacked adapters: one tensor each
    sizes = [size for kind in common.kinds for size in adapter_tensor_sizes(kind.run.model, adaptation, ep)]
    tensors = int(common.per_kind(lay, lambda r, _: len(adapter_tensor_sizes(r.model, adaptation, ep))
                                  + len(adaptation.targets) * adaptation.dora)) + len(full)
    routed = lay.summed.routed_adapters  # sharded with their experts, over the edp ranks
    grads = 0 if offload else on_zero_shard(lay.trainable, routed, param_shards, ep) * prec.param
    trained = on_zero_shard(lay.trainable, routed, state_shards, ep)
    optimizer = 0 if offload else optimizer_bytes(run.optimizer.name, prec, trained, tensors,
                                                   magnitudes // state_shards, matrices)
    largest = max([*sizes, *(math.prod(s) for s in full)], default=0)
    temp = 0 if offload else optimizer_step_temporaries(run, prec, (lay.trainable - magnitudes) // state_shards,
                                                        largest // state_shards, matrices)
    return StageStates(lay, prec, lay.summed.params + lay.embedding + lay.head, resident, grads, optimizer, temp,
                       common.fsdp, common.tokens, common.seq)


def _zero1_stage(run: Run, common: LayoutCommon, lay: RankLayout) -> StageStates:
    """ZeRO-1 (parallel/zero.py): parameters in the compute dtype, whole on every rank (2Ψ under
    *-mixed); flat gradient buffers in their dtype or fp32 (2Ψ or 4Ψ); master weights (fp32 under
    *-mixed, 4Ψ/N; otherwise the parameters' own rows) and optimizer states over N = dp_shard.
    Sharded terms are exact when N divides every dim 0 (the engine pads chunks to ceil(rows / N)).
    Its reduce-scatter and all-gather run in place in the gradient buffers: no bucket temporaries."""
    prec = common.prec
    n = lay.summed.params + lay.embedding + lay.head
    no_decay = lay.summed.no_decay + (common.counts.final_norm if lay.last else 0)
    shards = run.layout.zero_shards
    c = prec.act.compute  # the parameters' dtype: 16-bit under *-mixed and bf16-pure, else fp32
    grad = FP32 if run.layout.grad_accum_dtype == "fp32" else c
    master = prec.param  # fp32 masters under *-mixed; the parameters themselves otherwise
    params = n * c
    on_shard = on_zero_shard(n, lay.summed.experts, shards, run.layout.ep)
    matrices = matrix_shapes(run, common, lay, shards) if run.optimizer.name in PER_TENSOR_OPTIMIZERS else []
    persistent = on_shard * master if prec.mixed else params
    return StageStates(lay, prec, n, persistent, n * grad,
                  optimizer_bytes(run.optimizer.name, prec, on_shard, lay.tensors, no_decay // shards, matrices),
                  optimizer_step_temporaries(run, prec, (n - no_decay) // shards, lay.largest_tensor // shards,
                                              matrices),
                  False, common.tokens, common.seq, compute_params=params if prec.mixed else 0,
                  master_grads=on_shard * master if grad != master else 0)
