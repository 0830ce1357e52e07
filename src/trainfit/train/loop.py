"""The training loop around a built trainer (train/trainer.py): which steps the memory meter watches
and measures, logging, evaluation, checkpoint cadence, the throughput window, stop signals.

Every rank runs this same loop on its own rows of each global batch. Rank 0 alone prints and writes
metrics; the ranks stay in step through collectives (the loss and the stop flag are all-reduced
every step, every rank writes its shards of each checkpoint).

Memory is measured on a few steps, per component, on every rank (memory/measured/attribution.py): the
second step this process runs (its first is watched, so every tensor that outlives a step is
known), then every `logging.memory_interval` steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainfit.attention import AttentionKernel
from trainfit.config import Config
from trainfit.fp8_matmul import Fp8MatmulRates
from trainfit.memory import MemoryBreakdown
from trainfit.parallel.layout import Layout
from trainfit.perf.flops import mfu
from trainfit.precision import PrecisionPolicy
from trainfit.train.data import eval_batches
from trainfit.train.distributed import World
from trainfit.train.loss import IGNORE
from trainfit.train.metrics import MetricsWriter, ThroughputWindow
from trainfit.train.profile import StepProfiler
from trainfit.train.progress import TrainProgress
from trainfit.train.run_device import RunDevice
from trainfit.train.samples import SampleSplit
from trainfit.train.signals import StopOnSignal
from trainfit.train.step import StepStats, TrainStep


class Trainer(Protocol):
    """What the loop reads of the trainer that runs it (train/trainer.py's Trainer): its run, its state,
    and its steps. A protocol rather than the class, so that the trainer imports the loop and not back."""

    cfg: Config
    world: World
    layout: Layout
    device: torch.device
    policy: PrecisionPolicy
    run_device: RunDevice
    num_params: int
    notes: list[str]
    attention_kernel: AttentionKernel
    fp8_matmul: Fp8MatmulRates | None
    flops_per_token: float
    peak_flops: float | None
    resumed_from: Path | None

    @property
    def step(self) -> int: ...

    @property
    def skipped_steps(self) -> int: ...

    @property
    def scaler(self) -> torch.amp.GradScaler: ...

    def train_step(self) -> StepStats: ...

    def watched_step(self) -> StepStats: ...

    def measured_step(self) -> StepStats: ...

    def save(self) -> Path: ...

    def evaluate(self) -> float: ...


@dataclass
class TrainResult:
    steps_done: int
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float | None = None
    """Throughput of the last logged window of steps that are not instrumented (this process's
    first step, memory-measured and profiled steps, compile steps); None when every step was."""
    mfu: float | None = None
    """MFU of tokens_per_s against this device's peak (train/run_device.py); None when unknown."""
    mfu_note: str | None = None
    """Why MFU is what it is (the device matched, or why there is none)."""
    skipped_steps: int = 0
    stopped_by_signal: bool = False
    signal_name: str | None = None
    """SIGTERM / SIGINT when a signal stopped the run (None when it came to another rank)."""
    started_at: int = 0
    """The step this process started from (a resumed run's checkpoint step)."""
    checkpoint: Path | None = None
    num_params: int = 0
    layout: Layout | None = None
    """How the run was spread over its world (parallel/layout.py)."""
    world_size: int = 1
    rank: int = 0
    state_bytes: dict[str, int] | None = None
    """Rank `rank`'s model-state bytes (params, grads, optimizer) on its last measured step."""
    memory: MemoryBreakdown | None = None
    """Rank `rank`'s memory breakdown on its last measured step."""
    compile_seconds: float = 0.0
    """Wall time of the steps during which torch.compile compiled (training.compile), left out of tokens_per_s."""

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak (`memory.peak`), None before any measured step."""
        return self.memory.peak if self.memory is not None else None

    @property
    def steps_run(self) -> int:
        """Steps this process trained (0 when it resumed a run that was already complete)."""
        return self.steps_done - self.started_at


class _NoMetrics:
    """What ranks other than 0 write metrics to."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _next_step(trainer: Trainer, first_measured: int) -> StepStats:
    """Watched before `first_measured`, measured there and every logging.memory_interval steps."""
    step, interval = trainer.step + 1, trainer.cfg.logging.memory_interval
    if step == first_measured or (interval > 0 and step % interval == 0):
        return trainer.measured_step()
    return trainer.watched_step() if step < first_measured else trainer.train_step()


def train(trainer: Trainer) -> TrainResult:
    """Run `trainer` from its current step to training.steps (or a stop signal on any rank), then
    save a checkpoint of the last step unless the loop's cadence just did."""
    cfg, t, world, layout = trainer.cfg, trainer.cfg.training, trainer.world, trainer.layout
    result = TrainResult(steps_done=trainer.step, started_at=trainer.step, num_params=trainer.num_params, layout=layout,
                         world_size=world.size, rank=world.rank, skipped_steps=trainer.skipped_steps,
                         checkpoint=trainer.resumed_from, mfu_note=_mfu_note(trainer))
    writer: MetricsWriter | _NoMetrics = _NoMetrics()
    if world.is_main:
        writer = MetricsWriter(cfg.logging.dir, resume_step=trainer.step, tensorboard=cfg.logging.tensorboard)
    tokens_per_step = layout.global_batch_size * t.seq_len
    window = ThroughputWindow(tokens_per_step)
    last_saved = trainer.step if trainer.resumed_from else None
    first_measured = min(trainer.step + 2, t.steps)  # this process's second step: the first one warms up
    if not cfg.logging.measure_memory:
        first_measured = 0  # no step is watched or measured (_next_step)
    profiler = StepProfiler.from_config(cfg, rank=world.rank, world_size=world.size, device=trainer.device)
    interval = cfg.logging.memory_interval  # the memory meter's steps (_next_step), slower than the others
    instrumented = {*range(trainer.step + 1, first_measured + 1), *(range(interval, t.steps + 1, interval)
                                                                   if interval else ())}
    # Left out of tokens/s too: this process's first step (cuBLAS, NCCL and allocator warm-up) and
    # the profiled steps.
    untimed = {trainer.step + 1, *instrumented, *(range(profiler.window[0], profiler.window[1] + 1)
                                                  if profiler.window else ())}
    try:
        with StopOnSignal() as stop, \
                TrainProgress(t.steps, trainer.step, cfg.logging.progress, quiet=not world.is_main,
                              line_every=cfg.logging.interval) as bar:
            for note in trainer.notes + profiler.notes(trainer.step, instrumented):
                bar.announce(note)
                writer.write({"step": trainer.step, "note": note})
            writer.write({"step": trainer.step, "attention_kernel": trainer.attention_kernel.name,
                          "attention_op": trainer.attention_kernel.op})
            if trainer.fp8_matmul is not None:
                writer.write({"step": trainer.step, **trainer.fp8_matmul.record()})
            if trainer.step == 0 and t.eval_interval:
                result.val_losses[0] = _log_eval(trainer, writer, bar)
            stopping = world.any(stop.requested)
            while trainer.step < t.steps and not stopping:
                with profiler.step(trainer.step + 1):
                    stats = _next_step(trainer, first_measured)
                step = trainer.step
                if profiler.written and step == profiler.window[1]:
                    bar.announce(f"profiled step(s) {profiler.window_text}: one trace per rank in "
                                 f"{profiler.out_dir}; summary: trainfit report --profile {profiler.out_dir}")
                result.losses[step] = stats.loss
                result.state_bytes = stats.state_bytes or result.state_bytes
                result.memory = stats.memory or result.memory
                if stats.compiled:  # compile time is no training throughput
                    result.compile_seconds += stats.seconds
                    note = f"compile: {stats.seconds:.1f} s (step {step}, left out of tokens/s)"
                    bar.announce(note)
                    writer.write({"step": step, "note": note, "compile_seconds": stats.seconds})
                else:
                    window.add(stats.seconds, timed=step not in untimed, trained_tokens=stats.trained_tokens)
                bar.update(step, stats.loss, window.tokens_per_s() or result.tokens_per_s)
                if step % cfg.logging.interval == 0 or step == t.steps or stats.memory is not None:
                    tokens_per_s = window.tokens_per_s()
                    if tokens_per_s is not None:
                        result.tokens_per_s = tokens_per_s
                        result.mfu = (mfu(tokens_per_s, trainer.flops_per_token, trainer.peak_flops)
                                      if trainer.peak_flops else None)
                    record = _record(trainer, stats, tokens_per_s, result)
                    if stats.trained_tokens is not None:  # fine-tuning samples
                        record["trained_tokens"] = stats.trained_tokens
                        record["trained_tokens_per_s"] = window.trained_tokens_per_s()
                    writer.write(record)
                    window.reset()
                if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                    result.val_losses[step] = _log_eval(trainer, writer, bar)
                if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                    result.checkpoint, last_saved = trainer.save(), step
                stopping = world.any(stop.requested)  # a signal may reach one rank only
            result.stopped_by_signal, result.signal_name = stopping, stop.signal_name
            if stopping:
                bar.announce(f"received {stop.signal_name or 'a stop signal on another rank'}: "
                             f"saving a checkpoint at step {trainer.step}")
        if last_saved != trainer.step:
            result.checkpoint = trainer.save()
        world.barrier()  # leave together: a rank exiting early tears down connections others still use
    finally:
        profiler.close()
        writer.close()
    result.steps_done = trainer.step
    result.skipped_steps = trainer.skipped_steps
    return result


def _mfu_note(trainer: Trainer) -> str:
    hw = trainer.run_device.hardware
    if trainer.peak_flops is None:
        return trainer.run_device.note or "no peak FLOP/s for this device"
    what = f"hardware.peak_tflops={hw.peak_tflops:g}" if hw.peak_tflops else f"{hw.gpu}'s peak"
    return f"against {what}, {trainer.cfg.precision.mode}"


def _record(trainer: Trainer, stats: StepStats, tokens_per_s: float | None, result: TrainResult) -> dict[str, Any]:
    record: dict[str, Any] = {
        "step": trainer.step,
        "loss": stats.loss,
        "lr": stats.lr,
        "grad_norm": stats.grad_norm,
        "tokens_per_s": tokens_per_s,
        "mfu": result.mfu if tokens_per_s is not None else None,
        "peak_memory_bytes": result.peak_memory_bytes,
    }
    if stats.state_bytes is not None:
        record.update({f"{name}_bytes": n for name, n in stats.state_bytes.items()})
    if stats.memory is not None:  # a measured step
        record.update({f"memory_{name}_bytes": n for name, n in stats.memory.components().items()})
        record.update(memory_peak_phase=stats.memory.peak_phase,
                      memory_non_tensor_bytes=stats.memory.non_tensor,
                      memory_reserved_margin_bytes=stats.memory.reserved_margin)
        # CUDA only (measure.device_readings): the CPU has neither figure, so none is written there.
        record.update({f"memory_{name}_bytes": n for name in ("reserved_peak", "device_used")
                       if (n := getattr(stats.memory, name)) is not None})
    if trainer.policy.uses_loss_scaling:
        record["loss_scale"] = trainer.scaler.get_scale()
        record["skipped_steps"] = trainer.skipped_steps
    return record


def _log_eval(trainer: Trainer, writer: MetricsWriter | _NoMetrics, bar: TrainProgress) -> float:
    val_loss = trainer.evaluate()
    writer.write({"step": trainer.step, "val_loss": val_loss})
    bar.note(f"step {trainer.step}: val loss {val_loss:.4f}")
    return val_loss


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(step: TrainStep, val: Any) -> float:
    """Mean validation loss of `step`'s model over eval_steps global batches of fixed windows of
    `val` (the same windows whatever the layout and micro-batch size), in micro-batches split
    round-robin across the data-parallel ranks (the tp ranks of one replica run the same ones; a
    rank short of one reruns its last with weight 0: sharded models need every rank in every forward)."""
    if step.pipeline is not None:
        return _pipeline_evaluate(step, val)
    t, device, world = step.cfg.training, step.device, step.world
    num_batches = t.eval_steps * step.layout.global_batch_size // t.micro_batch_size
    batches = list(eval_batches(val, t.seq_len, t.micro_batch_size, num_batches, packing=step.cfg.data.packing))
    rank, size = world.dp_rank, world.dp_size
    totals = torch.zeros(2, device=device, dtype=torch.float64)  # (loss sum, batches; samples: trained targets)
    weighted = isinstance(val, SampleSplit)  # fine-tuning samples: the mean over the trained targets
    step.model.eval()
    for first in range(0, len(batches), size):
        index = first + rank
        inputs, targets, *documents = batches[min(index, len(batches) - 1)]
        with step.loss_context():
            loss = step.loss(inputs.to(device), targets.to(device), documents[0].to(device) if documents else None)[1]
        if index < len(batches):
            count = (step.model.sequence.shard(targets) != IGNORE).sum().to(device, torch.float64) if weighted else \
                torch.ones((), dtype=torch.float64, device=device)
            totals += torch.stack([loss.double() * count, count])
    step.model.train()
    world.sum_(totals)  # over every rank: each batch counted tp times, in both sums
    return (totals[0] / totals[1]).item()


def _pipeline_evaluate(step: TrainStep, val: Any) -> float:
    """evaluate() through the pipeline: the same windows, a step's rows of each data-parallel
    rank at a time (the schedule's micro-batches), forward only."""
    assert step.pipeline is not None
    t, layout, device, world = step.cfg.training, step.layout, step.device, step.world
    rows = layout.global_batch_size // layout.dp
    batches = list(eval_batches(val, t.seq_len, rows, t.eval_steps * layout.dp))
    losses, counts = [], []
    weighted = isinstance(val, SampleSplit)  # fine-tuning samples: the mean over the trained targets
    step.model.eval()
    for inputs, targets in batches[world.dp_rank::world.dp_size]:
        step.pipeline_losses.clear()
        with step.autocast(), step.loss_context():
            sequence = step.model.sequence
            local = sequence.shard(targets)
            step.pipeline.evaluate(sequence.shard(inputs).to(device), local.to(device))
        losses += step.pipeline_losses
        if step.pipeline_losses:  # the schedule's micro-batches, in its order (parallel/pipeline.py)
            counts += [float((part != IGNORE).sum()) if weighted else 1.0
                       for part in local.tensor_split(layout.num_microbatches)]
    step.model.train()
    totals = torch.tensor([sum(loss.item() * n for loss, n in zip(losses, counts, strict=True)), sum(counts)],
                          dtype=torch.float64, device=device)
    world.sum_(totals)  # the ranks of the last stage hold the losses
    return (totals[0] / totals[1]).item()
