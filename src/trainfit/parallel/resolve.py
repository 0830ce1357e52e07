"""A config resolved onto a world: `build_layout(cfg, world_size)` reads the user's config (never
writing into it), derives what is left open (dp_shard = -1, the micro-batch counts, the pipeline's
stage split) and checks every combination once; every impossible one is a `ConfigError` naming the
field, the value, why, and the nearest valid values. Also the global batch a config derives
(`global_batch_of`), the world size of a launched run and the torchrun command that launches one.
Torch-free.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, NamedTuple

from trainfit.config import Config, ConfigError
from trainfit.parallel.layout import Layout, offload_refusal
from trainfit.parallel.schedules import SCHEDULES, default_virtual_stages, refuses
from trainfit.parallel.stage_split import balanced_split
from trainfit.peft.spec import adaptation_of
from trainfit.sample_rows import SampleRows, prepared_rows


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
    _check_async_tp(cfg)
    adaptation = adaptation_of(m, cfg.peft, dp_shard * p.cp if p.zero_stage else 1)  # FSDP's shards, for NF4
    return Layout(world_size=world, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, pp=p.pp,
                  ep=p.ep, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel, pp_schedule=p.pp_schedule,
                  pp_virtual_stages=virtual, num_microbatches=accum,
                  pp_layers=_stage_layers(cfg, virtual) if p.pp > 1 else (m.num_layers,),
                  grad_accum_steps=accum, micro_batch_size=micro, global_batch_size=global_batch, seq_len=t.seq_len,
                  activation_checkpointing=mem.activation_checkpointing, ac_every_n_layers=mem.ac_every_n_layers,
                  offload=mem.offload, chunked_loss=mem.chunked_loss, precision=cfg.precision.mode,
                  fp8_scaling=cfg.precision.fp8_scaling, async_tp=p.async_tp, adaptation=adaptation,
                  fp8_all_gather=cfg.precision.fp8_all_gather,
                  grad_accum_dtype=cfg.optimizer.grad_accum_dtype, moe_imbalance=mem.moe_imbalance,
                  loss_chunk_tokens=mem.loss_chunk_tokens, compile=t.compile, optimizer=cfg.optimizer.name,
                  tie_embeddings=bool(m.tie_embeddings), rows=_sample_rows(cfg),
                  sp_recompute_gather=p.sp_recompute_gather)


def _sample_rows(cfg: Config) -> SampleRows | None:
    """The rows of fine-tuning samples prepared in data.path (sample_rows.prepared_rows); None for text, and
    for records not prepared yet (the trainer reads theirs once it tokenized them; the estimate command
    looks them up in the runs' cache: train/data.sample_rows_of)."""
    return prepared_rows(cfg.data.path, cfg.data.packing) if cfg.data.path else None


def _check_async_tp(cfg: Config) -> None:
    """parallel.async_tp against what torch's micro-pipeline TP needs: the sequence-parallel
    all-gathers and reduce-scatters it splits, inductor (it is a compiler pass), and CUDA's symmetric
    memory."""
    p = cfg.parallel
    if not p.async_tp or p.tp == 1:
        return
    if not p.sequence_parallel:
        why, fix = ("overlaps sequence parallelism's all-gathers and reduce-scatters with their GEMMs, and "
                    "parallel.sequence_parallel=false", "set parallel.sequence_parallel=true")
    elif not cfg.training.compile:
        why, fix = ("is an inductor pass (torch's micro-pipeline TP), and training.compile=false",
                    "set training.compile=true")
    elif cfg.hardware.gpu == "cpu":
        why, fix = ("needs CUDA GPUs (symmetric memory over NVLink), and hardware.gpu='cpu'",
                    "set parallel.async_tp=false, or a GPU in hardware.gpu")
    else:
        return
    raise ConfigError(f"parallel.async_tp=true: {why}; {fix}")


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
    if p.tp > 1 and m.qk_norm == "whole":
        raise _fail("parallel.tp", p.tp, "QK-norm over all heads (model.qk_norm=whole, OLMo 2) would need the "
                    "heads of every tp rank; not supported yet", "set parallel.tp=1 (FSDP, pipeline and context "
                    "parallelism shard it)")
    if p.cp > 1 and 0 < m.sliding_window < t.seq_len:
        raise _fail("parallel.cp", p.cp, f"context parallelism does not run a sliding window yet "
                    f"(model.sliding_window={m.sliding_window} < training.seq_len={t.seq_len})",
                    "set parallel.cp=1, or a training.seq_len within the window")
    if p.cp > 1 and m.attention_softcap:
        raise _fail("parallel.cp", p.cp, f"context parallelism does not run soft-capped attention scores yet "
                    f"(model.attention_softcap={m.attention_softcap}, Gemma 2)", "set parallel.cp=1")
    if p.tp > 1 and m.attention_sinks:
        raise _fail("parallel.tp", p.tp, "tensor parallelism does not shard attention sinks yet "
                    "(model.attention_sinks=true, gpt-oss)", "set parallel.tp=1 (FSDP, pipeline and expert "
                    "parallelism shard gpt-oss)")
    if p.cp > 1 and m.attention_sinks:
        raise _fail("parallel.cp", p.cp, "context parallelism does not run attention sinks yet "
                    "(model.attention_sinks=true, gpt-oss)", "set parallel.cp=1")
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
    schedule = SCHEDULES[p.pp_schedule]
    if schedule.fixed_stages and virtual != schedule.stages_per_rank:
        count = {1: "one", 2: "two"}.get(schedule.stages_per_rank, str(schedule.stages_per_rank))
        what = "one stage per rank" if schedule.single_stage else f"exactly {count} stages per rank" + (
            " (a V)" if schedule.v_shape else "")
        fix = f"set it to {schedule.stages_per_rank} or 0" + (
            ", or use parallel.pp_schedule='interleaved-1f1b' for several" if schedule.single_stage else "")
        raise _fail("parallel.pp_virtual_stages", p.pp_virtual_stages, f"{p.pp_schedule} runs {what}", fix)
    stages = p.pp * virtual
    if p.pp_layers_per_stage:
        given = list(p.pp_layers_per_stage)
        if len(given) != stages or sum(given) != m.num_layers:
            raise _fail("parallel.pp_layers_per_stage", given, f"give {stages} entries (pp x pp_virtual_stages = "
                        f"{p.pp} x {virtual}) summing to model.num_layers={m.num_layers}",
                        "or leave it empty to derive a balanced split")
        return tuple(given)
    if stages > m.num_layers + 1:
        fits = [d for d in range(1, m.num_layers + 2) if d * virtual <= m.num_layers + 1]
        raise _fail("parallel.pp", p.pp, f"pp x pp_virtual_stages = {p.pp} x {virtual} = {stages} stages for "
                    f"model.num_layers={m.num_layers} blocks (the derived split gives each stage one, but the last, "
                    "which may hold the head alone)", f"try pp={nearest(p.pp, fits)}, or set "
                    "parallel.pp_layers_per_stage (stages after the first may hold no block)")
    return balanced_split(m, cfg.training.seq_len, stages)


def _pipeline_microbatches(schedule: str, pp: int, virtual: int, wanted: int, accum: int, global_batch: int,
                           dp: int) -> int:
    """Pipeline micro-batches per step: parallel.num_microbatches (it must split the sequences each
    data-parallel rank runs per step, and the schedule must take it), else the accumulation steps,
    or failing that the smallest split of those sequences the schedule takes."""
    rows = global_batch // dp
    if wanted:
        why = (f"must divide the {rows} sequences each data-parallel rank runs per step (training.global_batch_size "
               "/ dp)") if rows % wanted else refuses(schedule, pp, virtual, wanted)
        if why:
            valid = _taken(schedule, pp, virtual, rows)
            raise _fail("parallel.num_microbatches", wanted, why, f"try {nearest(wanted, valid)}" if valid else
                        "raise training.global_batch_size")
        return wanted
    if refuses(schedule, pp, virtual, accum) is None:
        return accum
    valid = _taken(schedule, pp, virtual, rows)
    if not valid:
        least = SCHEDULES[schedule].least_microbatches(pp, virtual)
        raise _fail("training.global_batch_size", global_batch, f"each of the {dp} data-parallel ranks runs {rows} "
                    f"sequences per step, fewer than the {least} micro-batches parallel.pp_schedule={schedule!r} "
                    f"needs on {pp} pipeline ranks", f"set it to at least {least * dp}")
    return valid[0]


def _taken(schedule: str, pp: int, virtual: int, rows: int) -> list[int]:
    """The micro-batch counts `schedule` takes for `rows` sequences per data-parallel rank."""
    return [d for d in _divisors(rows) if refuses(schedule, pp, virtual, d) is None]


def _check_memory(cfg: Config) -> None:
    refused = offload_refusal(cfg.memory.offload, cfg.parallel.zero_stage)
    if refused:
        raise _fail("memory.offload", cfg.memory.offload, *refused)
