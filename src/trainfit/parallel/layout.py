"""The one frozen Layout of a run: how a training step is spread over the world, decided once.

`build_layout(cfg, world_size)` reads the user's config (never writing into it), derives what is
left open (dp_shard = -1, the micro-batch counts) and checks every combination once; every
impossible one is a `ConfigError` naming the field, the value, why, and the nearest valid values.
Everything downstream reads the Layout, not the config's parallel section: the device mesh
(`axes`), `parallelize`, both estimators, the trainer, checkpointing and the planner, which builds
thousands of them. Torch-free.

The world is a mesh pp x dp_replicate x dp_shard x cp x tp (outermost first: tensor parallelism
stays inside a node, pipeline stages span nodes). The data-parallel degree is what remains after
tp, pp and cp: dp = world_size / (tp x pp x cp) = dp_replicate x dp_shard. ZeRO stages 1-3 shard
over dp_shard x cp (the cp ranks of a replica hold the same parameters) and replicate over
dp_replicate (HSDP: for ZeRO-1, its shards are all-reduced across the replicas); stage 0
replicates over all dp x cp ranks (DDP).
Expert parallelism borrows its ranks from the data-parallel ones (ep divides dp_shard x cp).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from trainfit.config import Config, ConfigError
from trainfit.parallel.stage_split import (
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    RankPlacement,
    balanced_split,
    default_virtual_stages,
    rank_blocks,
    rank_placements,
    rank_shapes,
    rank_stages,
    stage_owners,
)

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
        return self.pp > 1 and self.pp_schedule in ZERO_BUBBLE_SCHEDULES

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
                    "activation_checkpointing='full' or 'none', or a schedule without split backward (1f1b, "
                    "interleaved-1f1b, gpipe, looped-bfs)")
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


def _fail(field: str, value: object, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{field}={value!r}: {why}; {fix}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def nearest(value: int, valid: list[int], count: int = 2) -> str:
    """The valid values closest to `value`, for error messages ("try 4 or 8")."""
    closest = sorted(sorted(set(valid), key=lambda v: (abs(v - value), v))[:count])
    return " or ".join(str(v) for v in closest)


def resolve_world_size(cfg: Config, launched: int | None) -> int:
    """The world size of a run of `launched` processes (1 without a launcher); None (not a run:
    an estimate) takes hardware.num_gpus.

    A config that leaves hardware.num_gpus at 1 takes the launcher's size; a config that names
    another device count contradicts the launcher, and we do not guess which one is meant."""
    wanted = cfg.hardware.num_gpus
    if launched is None or launched == wanted:
        return wanted
    if launched == 1:
        command = launch_command(wanted, cfg.hardware.gpus_per_node)
        raise _fail("hardware.num_gpus", wanted, f"this layout needs {wanted} processes (one per device) and "
                    "trainfit was started as one", f"launch it with\n  {command}")
    if wanted != 1:
        raise _fail("hardware.num_gpus", wanted, f"the launcher started {launched} processes",
                    f"start {wanted} (torchrun --nproc_per_node={wanted} ...) or set --hardware.num_gpus={launched}")
    return launched


def launch_command(num_procs: int, gpus_per_node: int) -> str:
    """The torchrun command that runs this trainfit invocation on `num_procs` processes."""
    args = sys.argv[1:] if sys.argv and sys.argv[0].endswith(("trainfit", "__main__.py")) else []
    trainfit_args = " ".join(shlex.quote(a) for a in args) if args else "train CONFIG [--section.field=value ...]"
    if num_procs <= gpus_per_node:
        return f"torchrun --nproc_per_node={num_procs} -m trainfit {trainfit_args}"
    nodes = -(-num_procs // gpus_per_node)
    return (f"torchrun --nnodes={nodes} --nproc_per_node={gpus_per_node} --rdzv-backend=c10d "
            f"--rdzv-endpoint=HOST:29500 -m trainfit {trainfit_args}   (on every node)")


def build_layout(cfg: Config, world_size: int | None = None) -> Layout:
    """The Layout of `cfg` (a resolved, validated config) on `world_size` ranks (default:
    hardware.num_gpus). Checks every degree against the world, the model and the batch."""
    p, m, t, mem = cfg.parallel, cfg.model, cfg.training, cfg.memory
    world = cfg.hardware.num_gpus if world_size is None else world_size
    _check_model_split(cfg)
    dp = _data_parallel_degree(cfg, world)
    if dp % p.dp_replicate:
        raise _fail("parallel.dp_replicate", p.dp_replicate, f"must divide the data-parallel degree "
                    f"num_gpus / (tp x pp x cp) = {dp}", f"try {nearest(p.dp_replicate, _divisors(dp))}")
    dp_shard = dp // p.dp_replicate if p.dp_shard == -1 else p.dp_shard
    if p.dp_replicate * dp_shard != dp:
        raise _fail("parallel.dp_shard", p.dp_shard, f"dp_replicate x dp_shard must equal num_gpus / (tp x pp x cp) "
                    f"= {dp}", f"set dp_shard={dp // p.dp_replicate} or -1 to derive it")
    if p.zero_stage > 0 and dp_shard * p.cp == 1 and dp > 1:
        raise _fail("parallel.zero_stage", p.zero_stage, f"ZeRO shards over dp_shard, which is 1 here "
                    f"(dp_replicate={p.dp_replicate})", "lower dp_replicate or use zero_stage=0")
    if p.ep > 1 and (dp_shard * p.cp) % p.ep:
        raise _fail("parallel.ep", p.ep, f"must divide dp_shard x cp = {dp_shard * p.cp} (expert ranks are carved "
                    "out of the data-parallel ones)",
                    f"try {nearest(p.ep, [d for d in _divisors(dp_shard * p.cp) if m.num_experts % d == 0])}")
    per_step = t.micro_batch_size * dp
    global_batch = _global_batch(t.global_batch_size, t.micro_batch_size, dp).size
    # Under pipeline parallelism with parallel.num_microbatches, that count sets the micro-batch.
    per_step = dp if p.pp > 1 and p.num_microbatches else per_step
    if global_batch % per_step and per_step == dp:
        raise _fail("training.global_batch_size", global_batch, f"must be a multiple of the data-parallel degree "
                    f"{dp}", f"try {nearest(global_batch, [dp * k for k in range(1, global_batch // dp + 2)])}")
    if global_batch % per_step:
        valid = [per_step * k for k in range(1, t.global_batch_size // per_step + 2)]
        fix = f"try {nearest(t.global_batch_size, valid)}"
        if t.global_batch_size % dp == 0:  # or a smaller micro-batch, with accumulation
            micro = nearest(t.micro_batch_size, _divisors(t.global_batch_size // dp), 1)
            fix += f", or training.micro_batch_size={micro}"
        raise _fail("training.global_batch_size", t.global_batch_size, f"must be a multiple of micro_batch_size x "
                    f"data-parallel degree = {t.micro_batch_size} x {dp} = {per_step}", fix)
    accum = global_batch // per_step
    micro, virtual = t.micro_batch_size, 1
    if p.pp > 1:
        virtual = p.pp_virtual_stages or default_virtual_stages(p.pp_schedule)
        accum = _pipeline_microbatches(p.pp_schedule, p.pp, virtual, p.num_microbatches, accum, global_batch, dp)
        micro = global_batch // dp // accum
    _check_memory(cfg)
    return Layout(world_size=world, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                  ep=p.ep, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule,
                  pp_virtual_stages=virtual, num_microbatches=accum,
                  pp_layers=_stage_layers(cfg, virtual) if p.pp > 1 else (m.num_layers,),
                  grad_accum_steps=accum, micro_batch_size=micro, global_batch_size=global_batch, seq_len=t.seq_len,
                  activation_checkpointing=mem.activation_checkpointing, ac_every_n_layers=mem.ac_every_n_layers,
                  offload=mem.offload, chunked_loss=mem.chunked_loss, precision=cfg.precision.mode,
                  fp8_scaling=cfg.precision.fp8_scaling, fp8_all_gather=cfg.precision.fp8_all_gather,
                  grad_accum_dtype=cfg.optimizer.grad_accum_dtype, moe_imbalance=mem.moe_imbalance,
                  loss_chunk_tokens=mem.loss_chunk_tokens, compile=t.compile, optimizer=cfg.optimizer.name,
                  tie_embeddings=bool(m.tie_embeddings))


class GlobalBatch(NamedTuple):
    """The sequences per optimizer step a run of a config takes, and where the number comes from."""

    size: int
    """Sequences per optimizer step, all ranks (Layout.global_batch_size)."""
    micro_batch_size: int = 0
    """training.micro_batch_size the batch is derived from; 0 when the config sets the batch."""
    dp: int = 0
    """Data-parallel ranks the batch is derived from (the config's own degrees: hardware.num_gpus /
    (tp x pp x cp)); 0 when the config sets the batch."""

    @property
    def derived(self) -> bool:
        """training.global_batch_size is 0: size is micro_batch_size x dp (no accumulation)."""
        return self.dp > 0

    def words(self) -> str:
        """'16 sequences (derived: micro_batch_size 16 x 1 data-parallel rank)'."""
        sequences = f"{self.size} sequence" + "s" * (self.size != 1)
        if not self.derived:
            return f"{sequences} (training.global_batch_size)"
        ranks = f"{self.dp} data-parallel rank" + "s" * (self.dp != 1)
        return f"{sequences} (derived: micro_batch_size {self.micro_batch_size} x {ranks})"

    def as_dict(self) -> dict[str, Any]:
        """global_batch_size and derived; when derived, the micro_batch_size and data_parallel_ranks it is from."""
        out: dict[str, Any] = {"global_batch_size": self.size, "derived": self.derived}
        if self.derived:
            out.update(micro_batch_size=self.micro_batch_size, data_parallel_ranks=self.dp)
        return out


def global_batch_of(cfg: Config) -> GlobalBatch:
    """training.global_batch_size, or when it is 0 the batch a run of cfg derives: micro_batch_size x
    the data-parallel ranks of cfg's own degrees on hardware.num_gpus, or build_layout's named error
    where those degrees do not split the model or the world. The planner and `estimate`'s fixes
    keep this batch while they change the micro-batch and the degrees."""
    t = cfg.training
    if t.global_batch_size:
        return _global_batch(t.global_batch_size, t.micro_batch_size, 0)
    _check_model_split(cfg)  # build_layout's first checks, in its order
    return _global_batch(0, t.micro_batch_size, _data_parallel_degree(cfg, cfg.hardware.num_gpus))


def _global_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> GlobalBatch:
    """The one rule (build_layout's and global_batch_of's): the batch set, or micro_batch_size x dp when 0."""
    if global_batch_size:
        return GlobalBatch(global_batch_size)
    return GlobalBatch(micro_batch_size * dp, micro_batch_size, dp)


def _data_parallel_degree(cfg: Config, world: int) -> int:
    """world / (tp x pp x cp), or the named error when the degrees do not divide the world."""
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    if world % model_parallel:
        raise _fail("hardware.num_gpus", world, f"must be a multiple of tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = "
                    f"{model_parallel}", f"use {nearest(world, [model_parallel * k for k in range(1, world + 2)])} "
                    "GPUs or lower a degree")
    return world // model_parallel


def _check_model_split(cfg: Config) -> None:
    """tp, pp and cp against the model's heads, layers and the sequence; ep against the experts."""
    p, m, t = cfg.parallel, cfg.model, cfg.training
    for name, heads in (("num_heads", m.num_heads), ("num_kv_heads", m.num_kv_heads)):
        if heads % p.tp:
            raise _fail("parallel.tp", p.tp, f"must divide model.{name}={heads} (each rank holds whole heads)",
                        f"try {nearest(p.tp, _divisors(heads))}")
    if p.tp > 1 and m.ffn_dim % p.tp:
        raise _fail("parallel.tp", p.tp, f"must divide model.ffn_dim={m.ffn_dim}",
                    f"try {nearest(p.tp, _divisors(m.ffn_dim))}")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise _fail("parallel.cp", p.cp, f"2 x cp must divide training.seq_len={t.seq_len} (load-balanced causal "
                    "sharding gives each rank two chunks)",
                    f"try cp={nearest(p.cp, [d for d in _divisors(t.seq_len) if t.seq_len % (2 * d) == 0])}")
    if p.ep > 1:
        if not m.num_experts:
            raise _fail("parallel.ep", p.ep, "expert parallelism needs an MoE model (model.num_experts > 0)",
                        "set parallel.ep=1")
        if m.num_experts % p.ep:
            raise _fail("parallel.ep", p.ep, f"must divide model.num_experts={m.num_experts}",
                        f"try {nearest(p.ep, _divisors(m.num_experts))}")


def _stage_layers(cfg: Config, virtual: int) -> tuple[int, ...]:
    """Blocks per pipeline stage: parallel.pp_layers_per_stage checked, or the balanced split."""
    p, m = cfg.parallel, cfg.model
    if p.pp_schedule in V_SCHEDULES and virtual != 2:
        raise _fail("parallel.pp_virtual_stages", p.pp_virtual_stages, f"{p.pp_schedule} runs exactly two stages "
                    "per rank (a V)", "set it to 2 or 0")
    if p.pp_schedule in ("gpipe", "1f1b") and virtual != 1:
        raise _fail("parallel.pp_virtual_stages", p.pp_virtual_stages, f"{p.pp_schedule} runs one stage per rank",
                    "set it to 1 or 0, or use parallel.pp_schedule='interleaved-1f1b' for several")
    stages = p.pp * virtual
    if p.pp_layers_per_stage:
        given = list(p.pp_layers_per_stage)
        if len(given) != stages or sum(given) != m.num_layers:
            raise _fail("parallel.pp_layers_per_stage", given, f"give {stages} entries (pp x pp_virtual_stages = "
                        f"{p.pp} x {virtual}) summing to model.num_layers={m.num_layers}",
                        "or leave it empty to derive a balanced split")
        return tuple(given)
    if stages > m.num_layers:
        raise _fail("parallel.pp", p.pp, f"pp x pp_virtual_stages = {p.pp} x {virtual} = {stages} stages for "
                    f"model.num_layers={m.num_layers} blocks (each stage runs at least one)",
                    f"try pp={nearest(p.pp, [d for d in range(1, m.num_layers + 1) if d * virtual <= m.num_layers])}")
    return balanced_split(m, cfg.training.seq_len, stages)


def _schedule_takes(schedule: str, pp: int, virtual: int, m: int) -> str | None:
    """Why torch's `schedule` refuses m micro-batches on pp ranks, or None: every schedule needs
    m >= pp; dualpipev m >= its 2 pp stages; the interleaved ones whole rounds (m a multiple of
    m // pp)."""
    if m < pp:
        return f"fewer micro-batches than the {pp} pipeline ranks leaves one idle the whole step"
    if schedule == "dualpipev" and m < pp * virtual:
        return f"dualpipev needs at least one micro-batch per stage ({pp * virtual})"
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble") and m % (m // pp):
        return f"{schedule} runs whole rounds: a multiple of m // pp = {m // pp} micro-batches"
    return None


def _pipeline_microbatches(schedule: str, pp: int, virtual: int, wanted: int, accum: int, global_batch: int,
                           dp: int) -> int:
    """Pipeline micro-batches per step: parallel.num_microbatches (it must split the sequences each
    data-parallel rank runs per step, and the schedule must take it), else the accumulation steps,
    or failing that the smallest split of those sequences the schedule takes."""
    rows = global_batch // dp
    if wanted:
        why = (f"must divide the {rows} sequences each data-parallel rank runs per step (training.global_batch_size "
               "/ dp)") if rows % wanted else _schedule_takes(schedule, pp, virtual, wanted)
        if why:
            valid = _taken(schedule, pp, virtual, rows)
            raise _fail("parallel.num_microbatches", wanted, why, f"try {nearest(wanted, valid)}" if valid else
                        "raise training.global_batch_size")
        return wanted
    if _schedule_takes(schedule, pp, virtual, accum) is None:
        return accum
    valid = _taken(schedule, pp, virtual, rows)
    if not valid:
        least = pp * virtual if schedule == "dualpipev" else pp
        raise _fail("training.global_batch_size", global_batch, f"each of the {dp} data-parallel ranks runs {rows} "
                    f"sequences per step, fewer than the {least} micro-batches parallel.pp_schedule={schedule!r} "
                    f"needs on {pp} pipeline ranks", f"set it to at least {least * dp}")
    return valid[0]


def _taken(schedule: str, pp: int, virtual: int, rows: int) -> list[int]:
    """The micro-batch counts `schedule` takes for `rows` sequences per data-parallel rank."""
    return [d for d in _divisors(rows) if _schedule_takes(schedule, pp, virtual, d) is None]


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


def _check_memory(cfg: Config) -> None:
    refused = offload_refusal(cfg.memory.offload, cfg.parallel.zero_stage)
    if refused:
        raise _fail("memory.offload", cfg.memory.offload, *refused)
