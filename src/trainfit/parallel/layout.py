"""The one frozen Layout of a run: how a training step is spread over the world, decided once.

Everything downstream reads the Layout, not the config's parallel section: the device mesh
(`axes`), `parallelize`, both estimators, the trainer, checkpointing and the planner, which builds
thousands of them. parallel/resolve.py builds it from a config (`build_layout`: derives what is left
open and checks every combination, each impossible one a `ConfigError` naming the field, the value,
why, and the nearest valid values); this module holds what a Layout is and what follows from it.
Torch-free.

The world is a mesh pp x dp_replicate x dp_shard x cp x tp (outermost first: tensor parallelism
stays inside a node, pipeline stages span nodes). The data-parallel degree is what remains after
tp, pp and cp: dp = world_size / (tp x pp x cp) = dp_replicate x dp_shard. ZeRO stages 1-3 shard
over dp_shard x cp (the cp ranks of a replica hold the same parameters) and replicate over
dp_replicate (HSDP: for ZeRO-1, its shards are all-reduced across the replicas); stage 0
replicates over all dp x cp ranks (DDP).
Expert parallelism borrows its ranks from the data-parallel ones (ep divides dp_shard x cp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainfit.parallel.schedules import SCHEDULES, micro_batches_in_flight
from trainfit.parallel.stage_split import (
    RankPlacement,
    rank_blocks,
    rank_placements,
    rank_shapes,
    rank_stages,
    stage_owners,
)
from trainfit.peft.spec import Adaptation
from trainfit.sample_rows import SampleRows

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh axes, outermost first: the one definition of the axis order (mesh.py and perf/comms.py)."""

DataParallel = Literal["none", "ddp", "zero1", "fsdp"]


@dataclass(frozen=True)
class Layout:
    world_size: int
    """Ranks (processes, one per device) in the run."""
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    zero_stage: int
    sequence_parallel: bool
    pp_schedule: str
    pp_virtual_stages: int
    """Stages per pipeline rank (parallel.pp_virtual_stages, derived when 0)."""
    pp_layers: tuple[int, ...]
    """Blocks of each pipeline stage, first to last (parallel/stage_split.py); (num_layers,) without pp."""
    num_microbatches: int
    """Micro-batches one rank runs per optimizer step (the pipeline schedule's m)."""
    grad_accum_steps: int
    """global_batch_size / (micro_batch_size x dp): micro-batches per rank per optimizer step; under
    pipeline parallelism the schedule's micro-batches (= num_microbatches)."""
    micro_batch_size: int
    """Sequences per micro-batch: training.micro_batch_size, or under pipeline parallelism the rows
    of a pipeline micro-batch (global_batch_size / (dp x num_microbatches))."""
    global_batch_size: int
    """Sequences per optimizer step, all ranks: training.global_batch_size, or micro_batch_size x dp
    when that is 0 (derived)."""
    seq_len: int
    """Tokens per sequence (training.seq_len), whole: context parallelism splits it over cp ranks."""
    activation_checkpointing: str
    ac_every_n_layers: int
    offload: str
    chunked_loss: bool
    precision: str
    """precision.mode: the dtypes the step computes, communicates and keeps its states in."""
    fp8_scaling: str = "tensorwise"
    """precision.fp8_scaling: torchao's float8 recipe under fp8-mixed (tensorwise | rowwise)."""
    async_tp: bool = False
    """parallel.async_tp: tensor parallelism's collectives overlap the GEMMs beside them."""
    adaptation: Adaptation | None = None
    """peft.*: the adapters and what trains beside them (peft/spec.py); None trains every parameter."""
    fp8_all_gather: bool = False
    """precision.fp8_all_gather: FSDP2 all-gathers the float8 linears' weights in fp8 (fp8-mixed, FSDP)."""
    grad_accum_dtype: str = "param"
    """optimizer.grad_accum_dtype: ZeRO-1's gradient buffers in the parameters' dtype or fp32."""
    loss_chunk_tokens: int = 1024
    """memory.loss_chunk_tokens: tokens per chunk of the chunked loss (when chunked_loss)."""
    moe_imbalance: float = 1.0
    """memory.moe_imbalance: the busiest expert's load over the balanced one that memory estimates
    assume for dropless routing (the estimators' assumption; training does not read it)."""
    compile: bool = False
    """training.compile: each transformer block torch.compile'd (train/parallelize.py)."""
    optimizer: str = "adamw"
    """optimizer.name: some optimizers need whole parameters (untrainable_reason)."""
    tie_embeddings: bool = False
    """model.tie_embeddings: the embedding and the output projection share one weight."""
    rows: SampleRows | None = None
    """Fine-tuning samples' rows (packed or padded, their lengths: sample_rows.py); None: a text stream."""
    sp_recompute_gather: bool = False
    """parallel.sp_recompute_gather: a column group keeps its input's sequence shard and all-gathers it
    again in backward (in blocks not checkpointed); only under sequence parallelism (`regathers`)."""
    ddp_master_weights: bool = False
    """Set by estimate() for an engine whose ZeRO-0 keeps ZeRO-1's states unsharded (perf/engines.py,
    Engine.ddp_master_weights): the module in the 16-bit dtype, fp32 master weights and gradient buffers in
    the optimizer. trainfit's own DDP and one-process runs autocast fp32 parameters instead (False)."""
    zero1_grad_all_reduce: bool = False
    """Set by estimate() for an engine whose ZeRO-1 all-reduces the whole gradient buffers after the backward
    (Engine.zero1_grad_reduce), where trainfit's ZeRO-1 reduce-scatters them to their shards."""

    @property
    def regathers(self) -> bool:
        """Whether unwrapped blocks re-gather their column groups' inputs in backward."""
        return self.sp_recompute_gather and self.sequence_parallel and self.tp > 1

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def zero_shards(self) -> int:
        """Ranks over which ZeRO/FSDP shards model states (1 under DDP): dp_shard x cp, since the
        cp ranks of a replica hold the same parameters (parallel/mesh.py's dp_shard_cp)."""
        return self.dp_shard * self.cp if self.zero_stage > 0 else 1

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens one rank's linear layers take per micro-batch: its rows' local sequences (1/cp each);
        a float8 linear's weight-gradient GEMM sums over them (float8.py pads them to a multiple of 16)."""
        return self.micro_batch_size * self.seq_len // self.cp

    @property
    def loss_tokens(self) -> int:
        """Tokens of one micro-batch that the loss of a rank (of the last stage) scores at once: its
        rows' local sequences (1/cp each). Tensor parallelism's ranks score every token of their
        micro-batch (sequence parallelism gathers the sequence first: train/loss.py)."""
        return self.micro_batch_size * self.seq_len // self.cp

    @property
    def loss_chunks(self) -> int:
        """Chunks of memory.loss_chunk_tokens the chunked loss splits loss_tokens into (1: the whole
        logits at once, as without it)."""
        return -(-self.loss_tokens // self.loss_chunk_tokens)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (virtual stages included)."""
        return self.pp * self.pp_virtual_stages

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The pipeline stages rank `pp_rank` of the pp axis runs, in model order."""
        return rank_stages(pp_rank, self.pp, self.pp_virtual_stages, self.pp_schedule)

    def stage_owners(self) -> tuple[int, ...]:
        """The pipeline rank running each stage, first stage to last."""
        return stage_owners(self.pp, self.pp_virtual_stages, self.pp_schedule)

    def rank_blocks(self, pp_rank: int) -> tuple[int, ...]:
        """Global indices of the blocks rank `pp_rank` of the pp axis runs, in model order."""
        return rank_blocks(pp_rank, self.pp_layers, self.pp, self.pp_virtual_stages, self.pp_schedule)

    def rank_placement(self, pp_rank: int) -> RankPlacement:
        """Where rank `pp_rank` of the pp axis sits: its stages and blocks, its neighbours on other ranks."""
        return rank_placements(self.pp_layers, self.pp, self.pp_virtual_stages, self.pp_schedule)[pp_rank]

    def micro_batches_in_flight(self, pp_rank: int) -> tuple[float, int]:
        """Micro-batches of activations alive on rank `pp_rank` of the pp axis at its peak, and of the head
        (parallel/schedules.py)."""
        return micro_batches_in_flight(self.pp, self.pp_virtual_stages, self.num_microbatches, self.pp_schedule,
                                       pp_rank)

    def rank_shapes(self) -> frozenset[tuple[int, int, bool]]:
        """The pipeline ranks' distinct (blocks, checkpointed blocks, runs the last stage)."""
        return rank_shapes(self.pp_layers, self.pp, self.pp_virtual_stages, self.pp_schedule, self.ac_every_n_layers)

    def busiest_rank_blocks(self) -> int:
        """Blocks of the pipeline rank that runs the most (all of them without pipeline parallelism)."""
        return max(blocks for blocks, _, _ in self.rank_shapes())

    @property
    def data_parallel(self) -> DataParallel:
        """How the data-parallel ranks share the model states (parallel/data_parallel.py's table)."""
        if self.offload != "none":
            return "fsdp"  # CPU offload is FSDP2's, on one rank too
        if self.zero_stage == 0 and self.ddp_master_weights:
            return "zero1"  # ZeRO-1's states over one shard: zero_shards is 1, DDP's all-reduce stays
        if self.dp * self.cp == 1:  # cp ranks average their gradients like data-parallel ones
            return "none"
        return {0: "ddp", 1: "zero1"}.get(self.zero_stage, "fsdp")

    @property
    def autocast(self) -> bool:
        """The forward runs under torch.amp's autocast (per-op casts to the compute dtype, fp32
        parameters and residual stream): the *-mixed modes where the parameters stay fp32, one
        process and DDP. FSDP2's MixedPrecisionPolicy and ZeRO-1 run the module itself in the 16-bit
        dtype. The trainer, both estimators and the time model read this."""
        return self.precision.endswith("-mixed") and self.data_parallel in ("none", "ddp")

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream (block inputs and outputs, norms' inputs): fp32
        under fp32 and autocast, else the 16-bit compute dtype's."""
        return 4 if self.precision == "fp32" or self.autocast else 2

    @property
    def splits_backward(self) -> bool:
        """The pipeline schedule runs each micro-batch's input and weight gradients apart."""
        return self.pp > 1 and SCHEDULES[self.pp_schedule].split_backward

    @property
    def sharded_loss_scaling(self) -> bool:
        """fp16-mixed's inf/nan check is all-reduced by torch's ShardedGradScaler (data_parallel.grad_scaler:
        FSDP2's gradient shards, a pipeline stage's gradients)."""
        return self.precision == "fp16-mixed" and (self.data_parallel == "fsdp" or self.pp > 1)

    @property
    def needs_process_group(self) -> bool:
        return self.data_parallel != "none" or self.world_size > 1

    def axis_sizes(self) -> dict[str, int]:
        """Every mesh axis and its size, outermost first (size-1 axes included)."""
        return {axis: getattr(self, axis) for axis in AXES}

    def mesh_axes(self) -> dict[str, int]:
        """The DeviceMesh's named axes: size-1 axes are left out, except dp_shard, which always
        exists (FSDP shards over it, even on one rank under CPU offload)."""
        return {axis: n for axis, n in self.axis_sizes().items() if n > 1 or axis == "dp_shard"}

    def ineffective_options(self) -> list[str]:
        """Options the user set that do nothing in this layout (warned about once, by the trainer)."""
        found = []
        if self.zero_stage and self.zero_shards == 1 and self.offload == "none":
            found.append(f"parallel.zero_stage={self.zero_stage} has no effect: one data-parallel rank holds every "
                         "shard")
        if self.async_tp and self.tp == 1:
            found.append("parallel.async_tp=true has no effect: it overlaps tensor parallelism's collectives, and "
                         "parallel.tp=1")
        if self.sp_recompute_gather and not self.regathers:
            found.append("parallel.sp_recompute_gather=true has no effect: it re-gathers sequence parallelism's "
                         "shards, and " + ("parallel.tp=1" if self.tp == 1 else "parallel.sequence_parallel=false"))
        if self.sequence_parallel and self.tp == 1:
            found.append("parallel.sequence_parallel=true has no effect: it shards along the sequence what tensor "
                         "parallelism leaves whole, and parallel.tp=1")
        if self.activation_checkpointing == "full" and self.splits_backward:
            found.append(f"memory.activation_checkpointing='full' under parallel.pp_schedule={self.pp_schedule!r} "
                         "saves no memory: the split backward keeps each block's recomputation alive (measured: "
                         "benchmarks/README.md); the traced estimate counts it, the analytic one does not")
        if self.zero_stage == 3 and self.splits_backward:
            found.append(f"parallel.zero_stage=3 keeps the parameters whole from forward to backward (as ZeRO-2) "
                         f"under parallel.pp_schedule={self.pp_schedule!r}: its split backward needs them "
                         "unsharded (FSDP2's reshard_after_forward=False)")
        if self.grad_accum_dtype == "fp32" and (self.data_parallel != "zero1" or self.precision == "fp32"):
            found.append("optimizer.grad_accum_dtype='fp32' has no effect: only ZeRO-1 (parallel.zero_stage=1 on "
                         "several ranks) in 16-bit precision accumulates gradients in a dtype of its own")
        if self.fp8_all_gather and (self.precision != "fp8-mixed" or self.data_parallel != "fsdp"):
            found.append("precision.fp8_all_gather=true has no effect: it all-gathers fp8-mixed's float8 weights "
                         "under FSDP2 (parallel.zero_stage 2 or 3 on several ranks, or memory.offload)")
        if self.chunked_loss and self.loss_chunks == 1:
            tokens, per_rank = self.loss_tokens, f" / cp={self.cp}" if self.cp > 1 else ""
            found.append(f"memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens={self.loss_chunk_tokens} "
                         f">= the {tokens} tokens of a micro-batch that a rank's loss scores ({self.micro_batch_size} "
                         f"sequences x {self.seq_len} tokens{per_rank}), so one chunk holds the whole logits (and is "
                         f"recomputed in backward); set memory.loss_chunk_tokens below {tokens}, e.g. "
                         f"{max(1, tokens // 4)}, or memory.chunked_loss=false")
        return found

    @property
    def fp8_gathers(self) -> bool:
        """FSDP2 all-gathers the float8 linears' weights in fp8 (precision.fp8_all_gather in effect)."""
        return self.fp8_all_gather and self.precision == "fp8-mixed" and self.data_parallel == "fsdp"

    def untrainable_reason(self) -> str | None:
        """Why `trainfit train` cannot run this layout yet (the analytic estimator can), or None. Every
        such rule is here and nowhere else: train reads it before any process group exists, the traced
        estimator before it builds anything, and the planner lists no layout it refuses."""
        if self.pp > 1 and self.data_parallel in ("ddp", "zero1"):
            ranks = f"{self.dp} data-parallel" + (f" x {self.cp} context-parallel" if self.cp > 1 else "")
            return (f"parallel.zero_stage={self.zero_stage} with parallel.pp={self.pp} and {ranks} ranks: pipeline "
                    "stages compose with FSDP2's data parallelism only; set parallel.zero_stage=2 or 3")
        if self.splits_backward and self.activation_checkpointing.startswith("selective"):
            return (f"memory.activation_checkpointing={self.activation_checkpointing!r} with parallel.pp_schedule="
                    f"{self.pp_schedule!r}: torch's selective checkpointing allows one backward through each region, "
                    "and zero-bubble schedules run two (input gradients, then weight gradients); use "
                    "activation_checkpointing='full' or 'none', or a schedule without split backward ("
                    + ", ".join(name for name, s in SCHEDULES.items() if not s.split_backward) + ")")
        if self.adaptation is not None and (self.tp > 1 or self.pp > 1 or self.cp > 1):
            degrees = ", ".join(f"parallel.{k}={v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))
                                if v > 1)
            return (f"peft.method={self.adaptation.method!r} with {degrees}: adapters are built for data and expert "
                    "parallelism only (DDP, FSDP2's ZeRO-2/3, CPU offload, parallel.ep); set those degrees to 1")
        if self.adaptation is not None and self.data_parallel == "zero1":
            return (f"peft.method={self.adaptation.method!r} with parallel.zero_stage=1: ZeRO-1's engine is not "
                    "built for frozen parameters; use parallel.zero_stage=0, 2 or 3")
        if self.adaptation is not None and self.adaptation.quantized and self.data_parallel == "fsdp" \
                and self.zero_shards == 1:
            return (f"peft.method='qlora' with memory.offload={self.offload!r} on one data-parallel rank: FSDP2's "
                    "one-rank unshard hands torchao's NF4 tensor one buffer where it gathers three; offload with "
                    "2 or more ranks, or set memory.offload='none'")
        if self.adaptation is not None and self.precision == "fp8-mixed":
            return (f"peft.method={self.adaptation.method!r} with precision.mode='fp8-mixed': float8 linears do not "
                    "carry adapters yet; use bf16-mixed, bf16-pure or fp32")
        if self.ep > 1 and self.tp > 1:
            return (f"parallel.ep={self.ep} with parallel.tp={self.tp}: not built with tensor parallelism yet "
                    "(the MoE is whole on every tp rank, and each would send the same tokens); set parallel.tp=1")
        if self.ep > 1 and self.dp_replicate > 1:
            return (f"parallel.ep={self.ep} with parallel.dp_replicate={self.dp_replicate}: the experts' HSDP mesh is "
                    f"not built yet; set parallel.dp_replicate=1 (dp_shard={self.dp}: FSDP over every rank)")
        if self.ep > 1 and self.data_parallel != "fsdp":
            return (f"parallel.zero_stage={self.zero_stage} with parallel.ep={self.ep}: expert parallelism composes "
                    "with FSDP2's data parallelism only (the experts are DTensors over the expert group, whose "
                    "gradients are reduced over the other groups: DDP and ZeRO-1 take plain tensors); set "
                    "parallel.zero_stage=2 or 3")
        if self.tp > 1 and self.precision == "fp16-mixed":
            return (f"precision.mode='fp16-mixed' with parallel.tp={self.tp}: fp16 loss scaling is not built for "
                    "tensor-parallel gradients yet; use bf16-mixed (no loss scaling needed)")
        if self.tp > 1 and self.data_parallel in ("ddp", "zero1"):
            ranks = f"{self.dp} data-parallel" + (f" x {self.cp} context-parallel" if self.cp > 1 else "")
            return (f"parallel.zero_stage={self.zero_stage} with parallel.tp={self.tp} and {ranks} ranks: tensor "
                    "parallelism composes with FSDP2's data parallelism only; set parallel.zero_stage=2 or 3")
        if self.tp > 1 and self.compile and self.activation_checkpointing == "full":
            return (f"training.compile=true with parallel.tp={self.tp} and memory.activation_checkpointing='full': "
                    "torch 2.13's partitioner saves the recomputed attention's RNG state after the device mesh "
                    "among a compiled block's saved values (torch/_functorch/partitioners.py "
                    "functionalize_rng_ops), and the block's forward fails; use "
                    "memory.activation_checkpointing='selective' (it keeps the attention's output, so nothing "
                    "random is recomputed) or 'none'")
        if self.tp > 1 and self.precision == "fp8-mixed":
            return (f"precision.mode='fp8-mixed' with parallel.tp={self.tp}: float8 linears need torchao's float8 "
                    "tensor-parallel styles (Float8ColwiseParallel, ...), which trainfit's plans do not use yet; "
                    "set parallel.tp=1 or use bf16-mixed")
        if self.tie_embeddings and self.pp > 1:
            return (f"model.tie_embeddings=True with parallel.pp={self.pp}: the embedding lives on the first stage and "
                    "the output projection on the last, and training does not keep the two copies in step (Megatron "
                    "all-reduces their gradients; the estimators count that copy); set model.tie_embeddings=false or "
                    "parallel.pp=1")
        if self.optimizer == "adafactor" and self.data_parallel == "zero1":
            return (f"optimizer.name='adafactor' with parallel.zero_stage=1 on {self.zero_shards} ranks: Adafactor's "
                    "factored statistics span whole parameters, and ZeRO-1 shards its states by rows; set "
                    "parallel.zero_stage=0, or use another optimizer")
        if self.optimizer == "adafactor" and (self.data_parallel == "fsdp" or self.tp > 1):
            by = (f"parallel.tp={self.tp}" if self.tp > 1 else f"memory.offload={self.offload!r}"
                  if self.offload != "none" else f"parallel.zero_stage={self.zero_stage} on {self.zero_shards} ranks")
            return (f"optimizer.name='adafactor' with {by}: the parameters are sharded DTensors (FSDP2's or tensor "
                    "parallelism's), on which torch's Adafactor fails (an in-place power of a partial norm), and "
                    "statistics factored per shard would not be Adafactor's; set parallel.zero_stage=0, "
                    "parallel.tp=1 and memory.offload='none', or use another optimizer")
        return None


def offload_refusal(offload: str, zero_stage: int) -> tuple[str, str] | None:
    """Why memory.offload cannot run at parallel.zero_stage, and the fix; None when it can. The one
    rule: build_layout raises it, the planner skips what it refuses. FSDP2's CPUOffloadPolicy is the
    offload engine."""
    if offload != "none" and zero_stage < 2:
        return ("CPU offload is FSDP2's (CPUOffloadPolicy), which shards gradients",
                f"set parallel.zero_stage=2 or 3 (it is {zero_stage})")
    if offload == "optimizer+params" and zero_stage != 3:
        return ("parameters leave the device after each block only under parallel.zero_stage=3",
                "set it to 3, or use memory.offload='optimizer' (ZeRO-Offload: states on the host, parameters "
                "whole on the device during the step)")
    return None
