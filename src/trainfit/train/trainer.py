"""The trainer: build -> step -> loop for one run of a config.

Build: the data, the model (train/build.py, shared with the traced estimator) materialized and
initialized on this rank's device, then the run's TrainStep around it (train/step.py: optimizer,
LR schedule, loss scaler, pipeline schedule), then resume from a checkpoint. Loop: `train()` runs
train/loop.py on it, which decides which steps the memory meter (memory/measured/attribution.py) watches
and measures; the meter wraps the same TrainStep that plain steps call.

One process, or one per rank under torchrun (train/distributed.py); every rank runs the same loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import warnings
from pathlib import Path

import torch
from torch import nn

from trainfit.attention import AttentionKernel, probe_attention_kernel
from trainfit.config import Config, ConfigError
from trainfit.configure import config_to_dict
from trainfit.fp8_matmul import Fp8MatmulRates, probe_fp8_matmul
from trainfit.memory.measured import Measurement, MemoryMeter, current_allocated_bytes
from trainfit.models import materialize
from trainfit.models.architecture import Architecture, describe
from trainfit.models.hf import load_hf_weights
from trainfit.models.init import init_magnitudes
from trainfit.parallel.layout import Layout
from trainfit.parallel.pipeline import PipelineStep
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.tensor_parallel import uneven_vocabulary
from trainfit.peft.spec import qlora_note
from trainfit.perf.flops import training_flops_per_token
from trainfit.sample_rows import rows_from_manifest
from trainfit.train import checkpoint as ckpt
from trainfit.train import loop
from trainfit.train.build import build_parallel_model, run_precision
from trainfit.train.data import BatchSampler, TokenData, data_cache_dir, resolve_data
from trainfit.train.distributed import World, init_world, run_layout
from trainfit.train.loop import TrainResult
from trainfit.train.optim import lr_at
from trainfit.train.run_device import this_run_device
from trainfit.train.samples import SampleSampler, SampleSplit, check_packing_layout, packed_attention_note
from trainfit.train.step import StepListener, StepStats, TrainingDiverged, TrainStep

__all__ = ["StepStats", "TrainResult", "Trainer", "TrainingDiverged", "data_cache_dir", "measure_step",
           "measure_trainer_step"]


class Trainer:
    MOMENTS = TrainStep.MOMENTS
    fp8_matmul: Fp8MatmulRates | None = None
    """fp8-mixed: this device's fp8 and bf16 matmul rates, probed before step 1 (trainfit.fp8_matmul)."""

    def __init__(self, cfg: Config, layout: Layout | None = None, world: World | None = None) -> None:
        """`layout`: None builds the run's own (distributed.run_layout). `world`: None joins the
        launcher's world (init_world); World() forces one process."""
        if world is None:
            self.layout = layout or run_layout(cfg)
            self.world = init_world(cfg, self.layout)
        else:
            self.layout = layout or world.layout or build_layout(cfg, world.size)
            self.world = world
        uneven = uneven_vocabulary(cfg.model.vocab_size, self.layout.tp)
        for message in [*self.layout.ineffective_options(), *([uneven] if uneven else [])]:
            warnings.warn(message, stacklevel=2)
        self.cfg = cfg
        self.device = self.world.device
        self.policy = run_precision(self.layout, self.device.type)
        self.data = self._load_data()
        self.packed = isinstance(self.data.train, SampleSplit) and cfg.data.packing
        """Rows of several fine-tuning samples each (train/packing.py), with their document ids."""
        if self.packed:
            check_packing_layout(self.layout)
        if isinstance(self.data.train, SampleSplit):  # the lengths of the samples now tokenized, for the estimates
            self.layout = dataclasses.replace(self.layout, rows=rows_from_manifest(self.data.manifest, self.packed))
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                f"({self.data.tokenizer.vocab_size}); raise model.vocab_size or use a smaller tokenizer")
        self.memory_floor = current_allocated_bytes(self.device)
        """In use before the model exists: what a measured step's reserved_margin counts from."""
        model, self.num_params = self._build_model()
        t = cfg.training
        if isinstance(self.data.train, SampleSplit):  # fine-tuning samples, one a row (train/samples.py)
            sampler: BatchSampler | SampleSampler = SampleSampler(
                self.data.train, t.seq_len, self.layout.micro_batch_size, t.seed, pad_id=self.pad_id,
                rank=self.world.dp_rank, world_size=self.world.dp_size, grad_accum_steps=self.layout.grad_accum_steps,
                truncation=cfg.data.truncation, packing=cfg.data.packing)
        else:
            sampler = BatchSampler(self.data.train, t.seq_len, self.layout.micro_batch_size, t.seed,
                                   rank=self.world.dp_rank, world_size=self.world.dp_size,
                                   grad_accum_steps=self.layout.grad_accum_steps)
        self.stepper = TrainStep(cfg, self.layout, self.world, self.policy, model, sampler,
                                 optimizer_device_type=self.device.type)
        """The run's training step (train/step.py): what train_step calls and the memory meter wraps."""
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.training.seq_len, self.layout.adaptation)
        self.run_device = this_run_device(cfg.hardware, cfg.precision.mode, self.device)
        """The hardware MFU is measured against: this process's device, matched to the catalog."""
        peak = self.run_device.peak_flops
        self.peak_flops = peak * self.world.size if peak is not None else None
        self.notes: list[str] = [note for note in (self.world.device_note, self.run_device.note) if note]
        """Messages for the log, printed when training starts (resume, schedule changes)."""
        self.attention_kernel = self._probe_attention_kernel()
        self.notes.append(self.attention_kernel.note())
        if isinstance(sampler, SampleSampler):
            self.notes.append(sampler.note())
        if self.packed:
            self.notes.append(packed_attention_note(self.device.type))
        layers_note = attention_layers_note(describe(cfg.model), t.seq_len)
        if layers_note:
            self.notes.append(layers_note)
        self.world.set_group_timeouts()  # the model's own groups (expert meshes) exist now
        if not t.global_batch_size:
            self.notes.append(f"training.global_batch_size derived: micro_batch_size {t.micro_batch_size} x "
                              f"{self.layout.dp} data-parallel rank(s) = {self.layout.global_batch_size} sequences "
                              "per step (set it to accumulate gradients over more)")
        if self.layout.pp > 1:
            rows = self.layout.global_batch_size // self.layout.dp
            self.notes.append(f"pipeline: {rows} sequences per step and data-parallel rank, in "
                              f"{self.layout.num_microbatches} micro-batches of {self.layout.micro_batch_size}"
                              + ("" if cfg.parallel.num_microbatches else " (derived: parallel.num_microbatches)"))
        if self.layout.adaptation is not None and self.layout.adaptation.method == "qlora":
            self.notes.append(qlora_note(cfg.model, self.layout.adaptation, self.layout.zero_shards))
        if self.policy.fp8_scaling is not None:
            from trainfit.float8 import float8_notes  # torchao: imported by fp8 runs only

            self.notes.extend(float8_notes(model))
            self.fp8_matmul = probe_fp8_matmul(self.device, self.policy.fp8_scaling)
            self.notes.append(self.fp8_matmul.note())
            if self.fp8_matmul.slow and self.world.is_main:
                warnings.warn(self.fp8_matmul.warning(), stacklevel=2)
        self.resumed_from = self._maybe_resume()

    # ------------------------------------------------------------ the step's parts

    @property
    def model(self) -> nn.Module:
        return self.stepper.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.stepper.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.stepper.scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler:
        return self.stepper.scaler

    @property
    def pipeline(self) -> PipelineStep | None:
        """Pipeline parallelism: the schedule that runs this rank's stages (parallel/pipeline.py)."""
        return self.stepper.pipeline

    @property
    def sampler(self) -> BatchSampler:
        return self.stepper.sampler

    @property
    def step(self) -> int:
        """Optimizer steps done (a resumed run's included)."""
        return self.stepper.steps_done

    @step.setter
    def step(self, value: int) -> None:
        self.stepper.steps_done = value

    @property
    def skipped_steps(self) -> int:
        return self.stepper.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.stepper.skipped_steps = value

    def listening(self, listener: StepListener) -> contextlib.AbstractContextManager[None]:
        """Call `listener(moment)` at each of MOMENTS of the steps run inside this block (TrainStep.listening)."""
        return self.stepper.listening(listener)

    # ------------------------------------------------------------ build

    def _probe_attention_kernel(self) -> AttentionKernel:
        """Which kernel training.attention_backend (applied by the step) runs: the run's compute
        dtype and device, a rank's heads (tensor parallelism splits them), causal, or under context
        parallelism an explicit mask (trainfit.attention)."""
        cfg, layout = self.cfg, self.layout
        m = cfg.model
        dtype = self.policy.autocast_dtype or self.policy.param_dtype
        arch = describe(m)
        return probe_attention_kernel(cfg.training.attention_backend, self.device, dtype, m.num_heads // layout.tp,
                                      m.num_kv_heads // layout.tp, arch.attention.head_dim,
                                      masked=layout.cp > 1 or self.packed
                                      or bool(arch.masked_windows(cfg.training.seq_len)))

    def _load_data(self) -> TokenData:
        """Node-local rank 0 tokenizes into the cache (once); the other ranks wait, then load it."""
        data, error = None, None
        if self.world.local_rank == 0:
            try:
                data = resolve_data(self.cfg.data, str(data_cache_dir()), self.cfg.model.init_from)
            except Exception as err:  # the other ranks must not wait for it forever
                error = err
        if self.world.any(error is not None):
            raise error or RuntimeError("preparing the data failed on another rank (see its error)")
        return data if data is not None else resolve_data(self.cfg.data, str(data_cache_dir()),
                                                          self.cfg.model.init_from)

    @property
    def pad_id(self) -> int:
        """The input id of a fine-tuning row's padding (its targets are ignored): end-of-text, else 0."""
        eot = self.data.tokenizer.eot_id
        return eot if eot is not None else 0

    def _build_model(self) -> tuple[nn.Module, int]:
        """Meta-device build -> parallelize -> this rank allocates and initializes only what it
        holds; the values depend on the seed and each parameter's name, not on the layout
        (models/init.py), so every layout starts from the same weights with no broadcast."""
        cfg = self.cfg
        built = build_parallel_model(cfg, self.layout, self.world.mesh, self.policy)
        model, num_params = built.model, built.num_params
        self.fingerprint = built.fingerprint
        """What this run's checkpoints hold (train/manifest.py): a checkpoint must match it to resume."""
        # CPU offload: FSDP2 wants the shards in host memory; buffers (RoPE) compute on the device.
        offload = self.layout.offload != "none"
        materialize(model, "cpu" if offload else self.device, cfg.training.seed)
        if cfg.model.init_from:  # the base's weights over the seeded ones; adapters keep theirs
            load_hf_weights(model, cfg.model, cfg.model.init_from)
            init_magnitudes(model)
        if offload and self.device.type != "cpu":
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    module._buffers[name] = buffer.to(self.device)
        torch.manual_seed(cfg.training.seed)  # training-time random streams
        return model, num_params

    # ------------------------------------------------------------ state

    def _maybe_resume(self) -> Path | None:
        path, warnings_ = ckpt.choose_checkpoint(self.cfg.checkpoint.resume, self.cfg.checkpoint.dir,
                                                 self.fingerprint, self.world)
        self.notes.extend(warnings_)
        if path is None:
            return None
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, world=self.world)
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self.scaler.load_state_dict(state["scaler"])
        # Checkpoints are taken between steps, so the data position is the step; stored as a
        # count of this rank's micro-batches, it is converted to this layout's accumulation.
        self.sampler.load_state_dict({**state["sampler"], "position": self.step * self.layout.grad_accum_steps})
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        ckpt.set_rng_state(rngs[self.world.rank] if len(rngs) == self.world.size else rngs[0], self.device)
        self._restart_schedule()
        saved_world, planned = state.get("world_size", 1), state.get("steps", self.cfg.training.steps)
        self.notes.append(f"resumed from {path} at step {self.step}"
                          + (f" (saved by {saved_world} ranks, resharded to {self.world.size})"
                             if saved_world != self.world.size else ""))
        if planned != self.cfg.training.steps:
            self.notes.append(f"the run was planned for {planned} steps; the learning-rate schedule is recomputed "
                              f"for training.steps={self.cfg.training.steps} from step {self.step} on")
        return path

    def _restart_schedule(self) -> None:
        """Restart the learning-rate schedule at the resumed step under the *current* config
        (optim.lr_at). The schedule is a function of the step alone, so nothing of the saved
        scheduler is needed: its per-group lists follow the saving layout's parameter groups
        (tensor parallelism splits them by layout) and its rates the saved training.steps."""
        self.scheduler.last_epoch = self.step
        lr = lr_at(self.step, self.cfg.training)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao's AdamW8bit: a tensor, which it requires
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def save(self) -> Path:
        """Write a checkpoint of the current step (collective: every rank calls it)."""
        state = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": self.world.gather_objects(ckpt.rng_state(self.device)),
            "steps": self.cfg.training.steps,
            "world_size": self.world.size,
        }
        return ckpt.save_checkpoint(self.cfg.checkpoint.dir, self.step, self.model, self.optimizer, state,
                                    config_to_dict(self.cfg), write_extras=self.data.save_extras,
                                    keep_last=self.cfg.checkpoint.keep_last, world=self.world,
                                    fingerprint=self.fingerprint)

    def close(self) -> None:
        """The end of `trainfit train`: drop the model, optimizer and schedule (and their reference
        cycles), then the process group if this trainer created it. In that order, so the process
        groups FSDP and DDP hold die now, with their worker threads, not at interpreter exit, where
        gloo's leftover work objects abort the process (pytorch/pytorch#179291 describes it; seen
        here once in ~20 two-rank runs on a busy machine). The trainer is not usable afterwards."""
        del self.stepper  # the model, optimizer, schedule, scaler, batches and pipeline with it
        gc.collect()
        self.world.close()

    # ------------------------------------------------------------ steps

    def train_step(self) -> StepStats:
        """One optimizer step over `grad_accum_steps` micro-batches of this rank's rows (TrainStep)."""
        return self.stepper()

    @functools.cached_property
    def memory_meter(self) -> MemoryMeter:
        """Measures this trainer's steps per component (memory/measured/attribution.py), made on first use."""
        return MemoryMeter(self.device, self.layout, rank=self.world.rank, world_size=self.world.size,
                           memory_floor=self.memory_floor)

    def watched_step(self) -> StepStats:
        """A train step whose new tensors the memory meter records (~15% slower): run this process's
        first steps so, or a later measured step misses what they left (DDP's gradient buckets)."""
        return self.memory_meter.watch(self.stepper)

    def measured_step(self) -> StepStats:
        """A train step measured at the allocator after every operator, per component, with the
        model states counted (up to twice as slow); `memory` holds the breakdown."""
        stats, measurement = self.memory_meter.measure(self.stepper)
        stats.memory, stats.state_bytes = measurement.breakdown, measurement.state_bytes
        return stats

    def evaluate(self) -> float:
        """Mean validation loss of the model now (train/loop.evaluate)."""
        return loop.evaluate(self.stepper, self.data.val)

    def train(self) -> TrainResult:
        """Train from the current step to training.steps (train/loop.py)."""
        return loop.train(self)


def measure_trainer_step(trainer: Trainer, *, warmup_steps: int = 0,
                         cuda_snapshot: str | Path | None = None) -> Measurement:
    """Run `warmup_steps` watched steps, then measure one more step of `trainer` on this rank.

    The trainer must have stepped at least once before the measured step (optimizer states and
    one-time library buffers would otherwise count): pass warmup_steps=1 to a fresh Trainer.
    Tensors created during the warm-up, or during earlier `Trainer.watched_step`s, are known to the
    meter (DDP's gradient buckets, the loss scaler's state); other such tensors count in
    reserved_margin, not in the peak.
    `cuda_snapshot`: on CUDA, also write the allocator's memory snapshot (pytorch.org/memory_viz)."""
    for _ in range(warmup_steps):
        trainer.watched_step()
    return trainer.memory_meter.measure(trainer.stepper, cuda_snapshot=cuda_snapshot)[1]


def measure_step(cfg: Config, steps: int = 2, *, cuda_snapshot: str | Path | None = None) -> Measurement:
    """Build a Trainer for `cfg` (joining torchrun's world when launched by it), run `steps - 1`
    warm-up steps and measure the last one on this rank (`trainfit measure`)."""
    if steps < 2:
        raise ConfigError(f"--steps {steps}: measure at least 2 steps (the first one warms up); try --steps 2")
    # From freshly initialized weights: a training run's checkpoint in checkpoint.dir is not loaded.
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="never"))
    trainer = Trainer(cfg)
    try:
        return measure_trainer_step(trainer, warmup_steps=steps - 1, cuda_snapshot=cuda_snapshot)
    finally:
        trainer.close()


def attention_layers_note(arch: Architecture, seq_len: int) -> str | None:
    """Which attention each kind of layer runs, where the layers differ from plain causal SDPA: the eager
    soft-capped attention (Gemma 2), or windowed layers (an explicit mask) beside global ones."""
    if arch.attention.sinks:
        return ("attention: attention sinks (model.attention_sinks) in every layer: the eager attention (its fp32 "
                "probabilities over the keys and the sink kept for backward), not SDPA")
    if arch.attention.softcap:
        return (f"attention: soft-capped scores (model.attention_softcap={arch.attention.softcap:g}) in every "
                "layer: the eager attention (its scores and fp32 probabilities kept for backward), not SDPA")
    windowed = [la.attention.window for la in arch.layers if la.attention.masked(seq_len)]
    if not windowed:
        return None
    return (f"attention: {len(windowed)} of {len(arch.layers)} layers attend a window of {max(windowed)} positions "
            "(SDPA with an explicit mask, the kernel above)" + (f", the other {len(arch.layers) - len(windowed)} "
                                                                 "the whole causal sequence" if len(windowed) <
                                                                 len(arch.layers) else ""))

