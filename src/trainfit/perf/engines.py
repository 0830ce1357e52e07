"""Whose training engine runs a step: trainfit's own (what `trainfit train` runs, and what every estimate
prices unless told otherwise) or another framework's, whose published or measured runs the benchmarks hold
the estimators to. Engines that run the same layout differ in a few places; each such difference is one
named behaviour here, read by the estimator that prices it, and everything else is priced as trainfit
runs it. Torch-free.

- `host`: the host side a GPU step waits on (perf/host_costs.py).
- `pipeline_buffers` (memory/closed_form/pipeline_held.py): "preallocated" is torch.distributed.pipelining,
  trainfit's: a receive slot per micro-batch and direction for the whole step, and the stage outputs (and,
  under the runtime schedules, every tensor sent) kept until the step ends. "per_op" is Megatron-Core's
  p2p_communication with deallocate_pipeline_outputs (Megatron-LM's training loop sets it): a receive
  allocates its tensor and the schedule consumes it, a stage output's storage is released once sent, so
  beyond its in-flight micro-batches' inputs (their first block's saved inputs, counted as activations) a
  rank holds one tensor per direction in transit.
- `layers` (memory/closed_form/block/te_layer.py): whose layers and loss keep the activations: trainfit's
  blocks, or "transformer_engine": Megatron-Core's layer of Transformer Engine modules (a dense pre-norm
  layer without dropout; others stay trainfit's) and its vocabulary-parallel cross entropy.
- `regather_overlaps_dgrad` (perf/timing.py): under parallel.sp_recompute_gather, whether the backward's
  all-gather of a column group's input runs while the group's input-gradient GEMMs do (Megatron-Core's
  LinearWithGradAccumulationAndAsyncCommunication and Transformer Engine's Linear launch it async, then
  compute dgrad, then wait). trainfit's saved-tensor hook gathers before the backward node runs: exposed.
- `ddp_master_weights` (Layout.ddp_master_weights, read by both memory and time): under ZeRO-0 (DDP, or one
  data-parallel rank) with a *-mixed precision, the module runs in the 16-bit dtype and the optimizer keeps
  fp32 master weights and fp32 gradient buffers beside it, unsharded: ZeRO-1's states on one shard, the
  activations a 16-bit model's. nanotron's FP32GradientAccumulator (optim/gradient_accumulator.py, built for
  every zero_stage when accumulate_grad_in_fp32) and Megatron-Core's Float16Module with main_grad buffers and
  Float16OptimizerWithFloat16Params do this; trainfit's DDP autocasts fp32 parameters (False).
- `zero1_grad_reduce` (Layout.zero1_grad_all_reduce, read by parallel/collectives.py): how ZeRO-1 reduces the
  accumulated gradient buffers at the step: "reduce_scatter" to each rank's shard (trainfit's parallel/zero.py,
  DeepSpeed's, Megatron-Core's distributed optimizer), or "all_reduce" of the whole buffers, after the backward
  (nanotron's trainer: sync_gradients_across_dp with reduce_scatter=False, "too memory hungry" otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainfit.perf.host_costs import NO_ENGINE_HOST, TRAINFIT, HostCosts

PipelineBuffers = Literal["preallocated", "per_op"]
Layers = Literal["trainfit", "transformer_engine"]
GradReduce = Literal["reduce_scatter", "all_reduce"]


@dataclass(frozen=True)
class Engine:
    """One engine's behaviours where engines differ (module docstring)."""

    name: str
    host: HostCosts
    pipeline_buffers: PipelineBuffers = "preallocated"
    layers: Layers = "trainfit"
    regather_overlaps_dgrad: bool = False
    ddp_master_weights: bool = False
    zero1_grad_reduce: GradReduce = "reduce_scatter"
    source: str = ""


TRAINFIT_ENGINE = Engine("trainfit", TRAINFIT, source="this repository's train/ (torch.distributed.pipelining)")
MEGATRON_CORE = Engine(
    "megatron-core", NO_ENGINE_HOST, pipeline_buffers="per_op", layers="transformer_engine",
    regather_overlaps_dgrad=True, ddp_master_weights=True,
    source="Megatron-LM core/pipeline_parallel/{schedules,p2p_communication}.py (deallocate_output_tensor), "
           "core/tensor_parallel/layers.py (LinearWithGradAccumulationAndAsyncCommunication.backward); its host "
           "side is not measured: launches only")
"""Megatron-LM, NeMo and Megatron-Bridge (they train through Megatron-Core)."""

