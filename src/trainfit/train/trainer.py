"""The training loop: build (meta device) -> parallelize -> materialize -> resume -> steps.

One process, or one per rank under torchrun (train/distributed.py); every rank runs this same loop
on its own rows of each global batch. Rank 0 alone prints, writes metrics and publishes
checkpoints; the ranks stay in step through collectives (the loss and the stop flag are
all-reduced every step, every rank writes its shards of each checkpoint).

Memory is measured on a few steps, per component, on every rank (memory/attribution.py): the
second step this process runs (its first is watched, so every tensor that outlives a step is
known), then every `logging.memory_interval` steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfit.attention import AttentionKernel, probe_attention_kernel, set_attention_backend
from trainfit.config import Config, ConfigError
from trainfit.configure import config_to_dict
from trainfit.fp8_matmul import Fp8MatmulRates, probe_fp8_matmul
from trainfit.memory.attribution import Measurement, MemoryMeter, measure_trainer_step
from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.measure import current_allocated_bytes
from trainfit.models import materialize
from trainfit.parallel.data_parallel import (
    clip_grad_norm_,
    grad_scaler,
    reduce_gradients,
    set_gradient_sync,
)
from trainfit.parallel.layout import Layout, build_layout
from trainfit.parallel.pipeline import PipelineStep, carry_aux_loss, stage_boundary
from trainfit.parallel.tensor_parallel import uneven_vocabulary, vocabulary_parallel_loss
from trainfit.perf.flops import mfu, training_flops_per_token
from trainfit.precision import precision_policy, step_optimizer
from trainfit.train import checkpoint as ckpt
from trainfit.train.build import build_parallel_model
from trainfit.train.data import BatchSampler, TokenData, eval_batches, resolve_data
from trainfit.train.distributed import World, init_world, run_layout
from trainfit.train.loss import loss_function
from trainfit.train.metrics import MetricsWriter, ThroughputWindow
from trainfit.train.optim import build_scheduler, lr_at, make_optimizer, param_groups
from trainfit.train.parallelize import parallelize_optimizer
from trainfit.train.profile import StepProfiler
from trainfit.train.progress import TrainProgress
from trainfit.train.run_device import this_run_device
from trainfit.train.signals import StopOnSignal


class TrainingDiverged(RuntimeError):
    """The loss became nan/inf outside fp16 loss scaling; nothing was saved over the last checkpoint."""


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    skipped: bool
    seconds: float
    lr: float
    state_bytes: dict[str, int] | None = None
    """This rank's model-state bytes (params, grads, optimizer), on measured steps."""
    memory: MemoryBreakdown | None = None
    """This rank's components at the peak, peak phase, phase peaks, non_tensor and reserved_margin (on
    CUDA also the reserved peak and the device's used bytes), on measured steps."""
    compiled: bool = False
    """torch.compile compiled something during this step (training.compile: the first step, and any
    recompilation): its time is compile time, reported apart and left out of tokens/s."""

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak (`memory.peak`), None before any measured step."""
        return self.memory.peak if self.memory is not None else None


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


def data_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainfit" / "data"


class _NoMetrics:
    """What ranks other than 0 write metrics to."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class StepParts:
    """A model built and parallelized by the caller, with its batches: what `Trainer(parts=...)`
    steps instead of building from the config (no data, no weight init, no resume). The traced
    estimator (traced.py) assembles its trainer so, so the step it traces is this one."""

    model: nn.Module
    num_params: int
    batches: Any
    """Anything with next_batch() -> (inputs, targets) of one micro-batch."""
    optimizer_device_type: str
    """The device the optimizer is built for (picks fused/foreach kernels)."""


StepListener = Callable[[str], None]
"""Called with each moment of a step (Trainer.MOMENTS): the instruments' hook into the step."""


class Trainer:
    MOMENTS = ("forward", "backward", "optimizer", "update")
    """forward: a micro-batch's forward and loss start; backward: its backward starts; optimizer:
    every micro-batch's backward is done, the gradient reduction (ZeRO-1's), unscaling and clipping
    start; update: every gradient is reduced, unscaled and clipped, the optimizer is about to step."""
    fp8_matmul: Fp8MatmulRates | None = None
    """fp8-mixed: this device's fp8 and bf16 matmul rates, probed before step 1 (trainfit.fp8_matmul)."""

    def __init__(self, cfg: Config, layout: Layout | None = None, world: World | None = None, *,
                 parts: StepParts | None = None) -> None:
        """`layout`: None builds the run's own (distributed.run_layout). `world`: None joins the
        launcher's world (init_world); World() forces one process. `parts`: step a model built by
        the caller (see StepParts) instead of building, initializing and resuming one."""
        if world is None:
            self.layout = layout or run_layout(cfg)
            self.world = init_world(cfg, self.layout)
        else:
            self.layout = layout or world.layout or build_layout(cfg, world.size)
            self.world = world
        if parts is None:  # once per run: not again from the step the traced estimator assembles
            uneven = uneven_vocabulary(cfg.model.vocab_size, self.layout.tp)
            for message in [*self.layout.ineffective_options(), *([uneven] if uneven else [])]:
                warnings.warn(message, stacklevel=2)
        self.cfg = cfg
        self.device = self.world.device
        self.policy = precision_policy(cfg.precision.mode, self.device.type, fp8_scaling=cfg.precision.fp8_scaling,
                                       fp8_all_gather=cfg.precision.fp8_all_gather)
        self._listeners: list[StepListener] = []
        if parts is not None:
            self.memory_floor = 0
            self._setup_step(parts.model, parts.num_params, parts.batches, parts.optimizer_device_type)
            self.resumed_from: Path | None = None
            return
        self.data = self._load_data()
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                f"({self.data.tokenizer.vocab_size}); raise model.vocab_size or use a smaller tokenizer")
        self.memory_floor = current_allocated_bytes(self.device)
        """In use before the model exists: what a measured step's reserved_margin counts from."""
        model, num_params = self._build_model()
        t = cfg.training
        sampler = BatchSampler(self.data.train, t.seq_len, self.layout.micro_batch_size, t.seed,
                               rank=self.world.dp_rank, world_size=self.world.dp_size,
                               grad_accum_steps=self.layout.grad_accum_steps)
        self._setup_step(model, num_params, sampler, self.device.type)
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
        if self.policy.fp8_scaling is not None:
            from trainfit.float8 import float8_notes  # torchao: imported by fp8 runs only

            self.notes.extend(float8_notes(model))
            self.fp8_matmul = probe_fp8_matmul(self.device, self.policy.fp8_scaling)
            self.notes.append(self.fp8_matmul.note())
            if self.fp8_matmul.slow and self.world.is_main:
                warnings.warn(self.fp8_matmul.warning(), stacklevel=2)
        self.resumed_from = self._maybe_resume()

    def _setup_step(self, model: nn.Module, num_params: int, batches: Any, optimizer_device_type: str) -> None:
        """Everything the step uses around a built, parallelized model: precision context,
        optimizer, schedule, loss scaler, batches, counters."""
        cfg = self.cfg
        self.model, self.num_params = model, num_params
        make = functools.partial(make_optimizer, opt=cfg.optimizer, train=cfg.training,
                                 device_type=optimizer_device_type,
                                 sharded_loss_scaling=self.layout.sharded_loss_scaling)
        self.optimizer = parallelize_optimizer(model, param_groups(model, cfg.training.weight_decay), make,
                                               self.layout, self.world.mesh, self.policy)
        # FSDP2 and ZeRO-1 compute with parameters in the compute dtype; autocast is the fp32-parameter form.
        self.autocast = self.policy.autocast if self.layout.autocast else contextlib.nullcontext
        # Tensor parallelism leaves the logits sharded over the vocabulary (parallel/tensor_parallel.py).
        self.loss_context = functools.partial(vocabulary_parallel_loss, self.layout.tp > 1)
        self.lm_loss = loss_function(self.layout.loss_chunk_tokens if self.layout.chunked_loss else 0,
                                     lambda: self.model.output)
        """(model output, targets) -> the micro-batch's mean cross-entropy (train/loss.py)."""
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.scaler = self.build_grad_scaler()
        self.pipeline = self._build_pipeline() if self.layout.pp > 1 else None
        """Pipeline parallelism: the schedule that runs this rank's stages (parallel/pipeline.py)."""
        self.sampler = batches
        """Anything with next_batch() -> (inputs, targets) of one micro-batch."""
        self.flops_per_token = training_flops_per_token(cfg.model, cfg.training.seq_len)
        self.run_device = this_run_device(cfg.hardware, cfg.precision.mode, self.device)
        """The hardware MFU is measured against: this process's device, matched to the catalog."""
        peak = self.run_device.peak_flops
        self.peak_flops = peak * self.world.size if peak is not None else None
        self.step = 0
        self.skipped_steps = 0
        self.notes: list[str] = [note for note in (self.world.device_note, self.run_device.note) if note]
        """Messages for the log, printed when training starts (resume, schedule changes)."""
        self.attention_kernel = self._choose_attention_kernel()
        self.notes.append(self.attention_kernel.note())

    def _choose_attention_kernel(self) -> AttentionKernel:
        """Apply training.attention_backend to every attention and probe which kernel it runs: the
        run's compute dtype and device, a rank's heads (tensor parallelism splits them), causal, or
        under context parallelism an explicit mask (trainfit.attention)."""
        cfg, layout = self.cfg, self.layout
        set_attention_backend(self.model, cfg.training.attention_backend)
        m = cfg.model
        dtype = self.policy.autocast_dtype or self.policy.param_dtype
        return probe_attention_kernel(cfg.training.attention_backend, self.device, dtype, m.num_heads // layout.tp,
                                      m.num_kv_heads // layout.tp, m.dim // m.num_heads, masked=layout.cp > 1)

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """The loss scaler (fp16: dynamic scaling; otherwise a disabled one). Subclasses may wrap it."""
        return grad_scaler(self.policy, self.model, self.optimizer, pipelined=self.layout.pp > 1)

    def _build_pipeline(self) -> PipelineStep:
        """The schedule of this rank's stages, with the loss it computes on the last stage: each
        micro-batch's language-model loss (kept in `_pipeline_losses` for the report) over the
        micro-batches, scaled under fp16; MoE stages add their auxiliary losses' gradients."""
        m = self.layout.num_microbatches
        self._pipeline_losses: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            lm_loss = self.lm_loss(logits, targets)
            self._pipeline_losses.append(lm_loss.detach())
            return self.scaler.scale(lm_loss) / m

        if self.cfg.model.num_experts:
            coefficient = self.cfg.model.router_aux_loss_coef
            scale = self.scaler.get_scale if self.scaler.is_enabled() else lambda: 1.0
            for stage in self.model.stages:
                carry_aux_loss(stage, lambda: coefficient * scale() / m)
        boundary = stage_boundary(self.cfg.model, self.cfg.training.seq_len, self.layout, self.policy)
        assert self.world.pp_mesh is not None
        return PipelineStep(self.model, self.layout, self.world.pp_mesh, self.device, boundary, loss_fn,
                            self._moment)

    @contextlib.contextmanager
    def listening(self, listener: StepListener) -> Iterator[None]:
        """Call `listener(moment)` at each of MOMENTS of the steps run inside this block."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)

    def _moment(self, moment: str) -> None:
        for listener in self._listeners:
            listener(moment)

    # ------------------------------------------------------------ build

    def _load_data(self) -> TokenData:
        """Node-local rank 0 tokenizes into the cache (once); the other ranks wait, then load it."""
        data, error = None, None
        if self.world.local_rank == 0:
            try:
                data = resolve_data(self.cfg.data, str(data_cache_dir()))
            except Exception as err:  # the other ranks must not wait for it forever
                error = err
        if self.world.any(error is not None):
            raise error or RuntimeError("preparing the data failed on another rank (see its error)")
        return data if data is not None else resolve_data(self.cfg.data, str(data_cache_dir()))

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
                                    config_to_dict(self.cfg), write_extras=self.data.tokenizer.save,
                                    keep_last=self.cfg.checkpoint.keep_last, world=self.world,
                                    fingerprint=self.fingerprint)

    def close(self) -> None:
        """The end of `trainfit train`: drop the model, optimizer and schedule (and their reference
        cycles), then the process group if this trainer created it. In that order, so the process
        groups FSDP and DDP hold die now, with their worker threads, not at interpreter exit, where
        gloo's leftover work objects abort the process (pytorch/pytorch#179291 describes it; seen
        here once in ~20 two-rank runs on a busy machine). The trainer is not usable afterwards."""
        self.model = self.optimizer = self.scheduler = self.scaler = self.sampler = None
        gc.collect()
        self.world.close()

    # ------------------------------------------------------------ step

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, language-model loss to report)."""
        sequence = self.model.sequence  # context parallelism: this rank's chunks of each row
        inputs, targets = sequence.shard(inputs), sequence.shard(targets)
        with self.autocast():  # the chunked loss projects the logits, in the forward's precision
            lm_loss = self.lm_loss(self.model(inputs), targets)
        aux = getattr(self.model, "aux_loss", None)
        if aux is not None and self.cfg.model.num_experts:
            return lm_loss + self.cfg.model.router_aux_loss_coef * aux, lm_loss
        return lm_loss, lm_loss

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, num_microbatches: int,
                         sync_gradients: bool) -> torch.Tensor:
        """One micro-batch of an optimizer step of `num_microbatches`: forward, loss, scaled
        backward; gradients accumulate. `sync_gradients`: reduce them across data-parallel ranks
        now (the step's last micro-batch). Returns the language-model loss (detached)."""
        set_gradient_sync(self.model, sync_gradients)
        self._moment("forward")
        with self.loss_context():
            loss, lm_loss = self._loss(inputs, targets)
            self._moment("backward")
            self.scaler.scale(loss / num_microbatches).backward()
        return lm_loss.detach()

    def pipeline_forward_backward(self) -> torch.Tensor:
        """The step's micro-batches through the pipeline schedule (forward, loss on the last stage,
        backward, in the schedule's order). Returns the sum of their language-model losses on the
        ranks of the last stage, 0 elsewhere."""
        assert self.pipeline is not None
        batches = [self.sampler.next_batch() for _ in range(self.layout.grad_accum_steps)]
        sequence = self.model.sequence  # context parallelism: this rank's chunks of each row
        inputs, targets = (sequence.shard(torch.cat(parts)).to(self.device) for parts in zip(*batches, strict=True))
        self._pipeline_losses.clear()
        self.scaler.scale(torch.zeros((), device=self.device))  # fp16: sets the scale where no loss is computed
        with self.autocast(), self.loss_context():
            self.pipeline.run(inputs, targets)
        losses = self._pipeline_losses
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    def optimizer_step(self) -> tuple[float, bool, float]:
        """Reduce the gradients (ZeRO-1's reduce-scatter; other engines reduced them in backward),
        unscale, clip by the global norm, step (unless fp16 found inf/nan), clear gradients, advance
        the schedule. Returns (gradient norm, skipped, learning rate used)."""
        self._moment("optimizer")
        reduce_gradients(self.optimizer)
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.training.grad_clip or math.inf
        pp_group = self.world.pp_mesh.get_group() if self.world.pp_mesh is not None else None
        grad_norm = clip_grad_norm_(self.model, self.optimizer, clip, pp_group)
        # A float now: torchao's AdamW8bit keeps lr a tensor, which the scheduler refills in place below.
        lr = float(self.optimizer.param_groups[0]["lr"])
        self._moment("update")
        skipped = not step_optimizer(self.optimizer, self.scaler)
        self.skipped_steps += int(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        if self.policy.fp8_all_gather:
            from trainfit.float8 import precompute_scales  # torchao: imported by fp8 runs only

            precompute_scales(self.model, self.policy)
        self.scheduler.step()
        return float(grad_norm), skipped, lr

    def train_step(self) -> StepStats:
        """One optimizer step over `grad_accum_steps` micro-batches of this rank's rows."""
        compiles = _compile_events()
        start = time.perf_counter()
        accum = self.layout.grad_accum_steps
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            total += self.pipeline_forward_backward()
        else:
            for i in range(accum):
                inputs, targets = (t.to(self.device, non_blocking=True) for t in self.sampler.next_batch())
                total += self.forward_backward(inputs, targets, num_microbatches=accum, sync_gradients=i == accum - 1)
        # Every micro-batch holds micro_batch_size x seq_len tokens (no padding), so the mean over
        # all tokens of the global batch is the mean of the micro-batch means over all ranks (under
        # pipeline parallelism, the ranks of the last stage: the others add 0).
        loss_value = self.world.sum_(total).item() / (accum * self.world.size // self.layout.pp)
        if not math.isfinite(loss_value) and not self.policy.uses_loss_scaling:  # the same on every rank
            raise TrainingDiverged(
                f"step {self.step + 1}: the loss is {loss_value}; stopping without saving "
                f"(the last good checkpoint in {self.cfg.checkpoint.dir!r} is kept). Lower training.lr, "
                "enable training.grad_clip, or use bf16-mixed instead of a pure low-precision mode")
        grad_norm, skipped, lr = self.optimizer_step()
        self.step += 1
        return StepStats(loss_value, grad_norm, skipped, time.perf_counter() - start, lr,
                         compiled=_compile_events() != compiles)

    @functools.cached_property
    def memory_meter(self) -> MemoryMeter:
        """Measures this trainer's steps per component (memory/attribution.py), made on first use."""
        return MemoryMeter(self.device, self.layout)

    def watched_step(self) -> StepStats:
        """A train step whose new tensors the memory meter records (~15% slower): run this process's
        first steps so, or a later measured step misses what they left (DDP's gradient buckets)."""
        return self.memory_meter.watch(self)

    def measured_step(self) -> StepStats:
        """A train step measured at the allocator after every operator, per component, with the
        model states counted (up to twice as slow); `memory` holds the breakdown."""
        stats, measurement = self.memory_meter.measure(self)
        stats.memory, stats.state_bytes = measurement.breakdown, measurement.state_bytes
        return stats

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over eval_steps global batches of fixed windows (the same windows
        whatever the layout and micro-batch size), in micro-batches split round-robin across the
        data-parallel ranks (the tp ranks of one replica run the same ones; a rank short of one
        reruns its last with weight 0: sharded models need every rank in every forward)."""
        if self.pipeline is not None:
            return self._pipeline_evaluate()
        t = self.cfg.training
        num_batches = t.eval_steps * self.layout.global_batch_size // t.micro_batch_size
        batches = list(eval_batches(self.data.val, t.seq_len, t.micro_batch_size, num_batches))
        rank, size = self.world.dp_rank, self.world.dp_size
        totals = torch.zeros(2, device=self.device, dtype=torch.float64)  # (loss sum, batches)
        self.model.eval()
        for first in range(0, len(batches), size):
            index = first + rank
            inputs, targets = batches[min(index, len(batches) - 1)]
            with self.loss_context():
                loss = self._loss(inputs.to(self.device), targets.to(self.device))[1]
            if index < len(batches):
                totals += torch.stack([loss.double(), torch.ones((), dtype=torch.float64, device=self.device)])
        self.model.train()
        self.world.sum_(totals)  # over every rank: each batch counted tp times, in both sums
        return (totals[0] / totals[1]).item()

    def _pipeline_evaluate(self) -> float:
        """evaluate() through the pipeline: the same windows, a step's rows of each data-parallel
        rank at a time (the schedule's micro-batches), forward only."""
        assert self.pipeline is not None
        t, layout = self.cfg.training, self.layout
        rows = layout.global_batch_size // layout.dp
        batches = list(eval_batches(self.data.val, t.seq_len, rows, t.eval_steps * layout.dp))
        losses = []
        self.model.eval()
        for inputs, targets in batches[self.world.dp_rank::self.world.dp_size]:
            self._pipeline_losses.clear()
            with self.autocast(), self.loss_context():
                sequence = self.model.sequence
                self.pipeline.evaluate(sequence.shard(inputs).to(self.device), sequence.shard(targets).to(self.device))
            losses += self._pipeline_losses
        self.model.train()
        totals = torch.tensor([sum(loss.item() for loss in losses), len(losses)], dtype=torch.float64,
                              device=self.device)
        self.world.sum_(totals)  # the ranks of the last stage hold the losses
        return (totals[0] / totals[1]).item()

    # ------------------------------------------------------------ loop

    def _next_step(self, first_measured: int) -> StepStats:
        """Watched before `first_measured`, measured there and every logging.memory_interval steps."""
        step, interval = self.step + 1, self.cfg.logging.memory_interval
        if step == first_measured or (interval > 0 and step % interval == 0):
            return self.measured_step()
        return self.watched_step() if step < first_measured else self.train_step()

    def train(self) -> TrainResult:
        cfg, t, world = self.cfg, self.cfg.training, self.world
        result = TrainResult(steps_done=self.step, started_at=self.step, num_params=self.num_params, layout=self.layout,
                             world_size=world.size, rank=world.rank, skipped_steps=self.skipped_steps,
                             checkpoint=self.resumed_from, mfu_note=self._mfu_note())
        writer: MetricsWriter | _NoMetrics = _NoMetrics()
        if world.is_main:
            writer = MetricsWriter(cfg.logging.dir, resume_step=self.step, tensorboard=cfg.logging.tensorboard)
        tokens_per_step = self.layout.global_batch_size * t.seq_len
        window = ThroughputWindow(tokens_per_step)
        last_saved = self.step if self.resumed_from else None
        first_measured = min(self.step + 2, t.steps)  # this process's second step: the first one warms up
        if not cfg.logging.measure_memory:
            first_measured = 0  # no step is watched or measured (_next_step)
        profiler = StepProfiler.from_config(cfg, rank=world.rank, world_size=world.size, device=self.device)
        interval = cfg.logging.memory_interval  # the memory meter's steps (_next_step), slower than the others
        instrumented = {*range(self.step + 1, first_measured + 1), *(range(interval, t.steps + 1, interval)
                                                                     if interval else ())}
        # Left out of tokens/s too: this process's first step (cuBLAS, NCCL and allocator warm-up) and
        # the profiled steps.
        untimed = {self.step + 1, *instrumented, *(range(profiler.window[0], profiler.window[1] + 1)
                                                   if profiler.window else ())}
        try:
            with StopOnSignal() as stop, \
                    TrainProgress(t.steps, self.step, cfg.logging.progress, quiet=not world.is_main,
                                  line_every=cfg.logging.interval) as bar:
                for note in self.notes + profiler.notes(self.step, instrumented):
                    bar.announce(note)
                    writer.write({"step": self.step, "note": note})
                writer.write({"step": self.step, "attention_kernel": self.attention_kernel.name,
                              "attention_op": self.attention_kernel.op})
                if self.fp8_matmul is not None:
                    writer.write({"step": self.step, **self.fp8_matmul.record()})
                if self.step == 0 and t.eval_interval:
                    result.val_losses[0] = self._log_eval(writer, bar)
                stopping = world.any(stop.requested)
                while self.step < t.steps and not stopping:
                    with profiler.step(self.step + 1):
                        stats = self._next_step(first_measured)
                    if profiler.written and self.step == profiler.window[1]:
                        bar.announce(f"profiled step(s) {profiler.window_text}: one trace per rank in "
                                     f"{profiler.out_dir}; summary: trainfit report --profile {profiler.out_dir}")
                    result.losses[self.step] = stats.loss
                    result.state_bytes = stats.state_bytes or result.state_bytes
                    result.memory = stats.memory or result.memory
                    if stats.compiled:  # compile time is no training throughput
                        result.compile_seconds += stats.seconds
                        note = f"compile: {stats.seconds:.1f} s (step {self.step}, left out of tokens/s)"
                        bar.announce(note)
                        writer.write({"step": self.step, "note": note, "compile_seconds": stats.seconds})
                    else:
                        window.add(stats.seconds, timed=self.step not in untimed)
                    bar.update(self.step, stats.loss, window.tokens_per_s() or result.tokens_per_s)
                    if self.step % cfg.logging.interval == 0 or self.step == t.steps or stats.memory is not None:
                        tokens_per_s = window.tokens_per_s()
                        if tokens_per_s is not None:
                            result.tokens_per_s = tokens_per_s
                            result.mfu = (mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
                                          if self.peak_flops else None)
                        writer.write(self._record(stats, tokens_per_s, result))
                        window.reset()
                    if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
                        result.val_losses[self.step] = self._log_eval(writer, bar)
                    if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                        result.checkpoint, last_saved = self.save(), self.step
                    stopping = world.any(stop.requested)  # a signal may reach one rank only
                result.stopped_by_signal, result.signal_name = stopping, stop.signal_name
                if stopping:
                    bar.announce(f"received {stop.signal_name or 'a stop signal on another rank'}: "
                                 f"saving a checkpoint at step {self.step}")
            if last_saved != self.step:
                result.checkpoint = self.save()
            world.barrier()  # leave together: a rank exiting early tears down connections others still use
        finally:
            profiler.close()
            writer.close()
        result.steps_done = self.step
        result.skipped_steps = self.skipped_steps
        return result

    def _mfu_note(self) -> str:
        hw = self.run_device.hardware
        if self.peak_flops is None:
            return self.run_device.note or "no peak FLOP/s for this device"
        what = f"hardware.peak_tflops={hw.peak_tflops:g}" if hw.peak_tflops else f"{hw.gpu}'s peak"
        return f"against {what}, {self.cfg.precision.mode}"

    def _record(self, stats: StepStats, tokens_per_s: float | None, result: TrainResult) -> dict[str, Any]:
        record: dict[str, Any] = {
            "step": self.step,
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
        if self.policy.uses_loss_scaling:
            record["loss_scale"] = self.scaler.get_scale()
            record["skipped_steps"] = self.skipped_steps
        return record

    def _log_eval(self, writer: MetricsWriter | _NoMetrics, bar: TrainProgress) -> float:
        val_loss = self.evaluate()
        writer.write({"step": self.step, "val_loss": val_loss})
        bar.note(f"step {self.step}: val loss {val_loss:.4f}")
        return val_loss


def _compile_events() -> int:
    """How many compilations torch.compile has timed in this process (dynamo frames, inductor's
    forward and backward graphs): a step that changes it compiled something."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(len(times) for times in compilation_time_metrics.values())


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
