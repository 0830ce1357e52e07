"""One training step of a built, parallelized model: `forward_backward` over the step's micro-batches
(or the pipeline schedule's, `pipeline_forward_backward`), then `optimizer_step` (gradient
reduction, unscaling, clipping, the optimizer, the LR schedule).

A `TrainStep` is called once per optimizer step. Listeners (`listening`) hear its moments (MOMENTS):
the hooks that instruments attach to without knowing who built the step: the memory meter
(memory/measured/attribution.py), the traced estimator (traced.py), a benchmark's timer. The trainer
(train/trainer.py) and the traced estimator build their steps through this one class, so the step
that is traced is the step that trains.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainfit.attention import set_attention_backend
from trainfit.config import Config
from trainfit.memory import MemoryBreakdown
from trainfit.parallel.data_parallel import clip_grad_norm_, grad_scaler, reduce_gradients, set_gradient_sync
from trainfit.parallel.layout import Layout
from trainfit.parallel.pipeline import PipelineStep, carry_aux_loss, stage_boundary
from trainfit.parallel.tensor_parallel import vocabulary_parallel_loss
from trainfit.precision import PrecisionPolicy, step_optimizer
from trainfit.train.distributed import World
from trainfit.train.loss import IGNORE, loss_function
from trainfit.train.optim import build_scheduler, make_optimizer, param_groups
from trainfit.train.parallelize import parallelize_optimizer


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
    trained_tokens: int | None = None
    """Fine-tuning samples: the trained targets of the step's global batch (the rest is prompt and padding)."""

    @property
    def peak_memory_bytes(self) -> int | None:
        """This rank's measured peak (`memory.peak`), None before any measured step."""
        return self.memory.peak if self.memory is not None else None


StepListener = Callable[[str], None]
"""Called with each moment of a step (TrainStep.MOMENTS): the instruments' hook into the step."""


class TrainStep:
    """The step of `cfg` on `layout` around a model built and parallelized by the caller (on its
    device, or under fake tensors), with the optimizer, LR schedule, loss scaler and pipeline
    schedule it builds for it. `batches`: anything with next_batch() -> (inputs, targets) of one
    micro-batch, or (inputs, targets, document ids) of packed rows. `optimizer_device_type`: the
    device the optimizer is built for (picks fused/foreach kernels). Calling it runs one optimizer
    step and returns its StepStats."""

    MOMENTS = ("forward", "backward", "optimizer", "update")
    """forward: a micro-batch's forward and loss start; backward: its backward starts; optimizer:
    every micro-batch's backward is done, the gradient reduction (ZeRO-1's), unscaling and clipping
    start; update: every gradient is reduced, unscaled and clipped, the optimizer is about to step."""

    def __init__(self, cfg: Config, layout: Layout, world: World, policy: PrecisionPolicy, model: nn.Module,
                 batches: Any, *, optimizer_device_type: str) -> None:
        self.cfg, self.layout, self.world, self.policy = cfg, layout, world, policy
        self.device = world.device
        self.model = model
        self._listeners: list[StepListener] = []
        make = functools.partial(make_optimizer, opt=cfg.optimizer, train=cfg.training,
                                 device_type=optimizer_device_type,
                                 sharded_loss_scaling=layout.sharded_loss_scaling)
        self.optimizer = parallelize_optimizer(model, param_groups(model, cfg.training.weight_decay), make,
                                               layout, world.mesh, policy)
        # FSDP2 and ZeRO-1 compute with parameters in the compute dtype; autocast is the fp32-parameter form.
        self.autocast = policy.autocast if layout.autocast else contextlib.nullcontext
        # Tensor parallelism leaves the logits sharded over the vocabulary (parallel/tensor_parallel.py).
        self.loss_context = functools.partial(vocabulary_parallel_loss, layout.tp > 1)
        self.lm_loss = loss_function(layout.loss_chunk_tokens if layout.chunked_loss else 0, lambda: self.model.output,
                                     softcap=cfg.model.final_softcap,
                                     masked=getattr(batches, "step_trained_tokens", None) is not None,
                                     traced_share=layout.rows.scored_share(cfg.training.seq_len)
                                     if layout.rows is not None else 1.0)
        """(model output, targets) -> the micro-batch's mean cross-entropy (train/loss.py)."""
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.scaler = self.build_grad_scaler()
        self.pipeline_losses: list[torch.Tensor] = []
        """Pipeline parallelism: each micro-batch's language-model loss of the last schedule run (last stage)."""
        self.step_tokens: int | None = None
        """The pipeline step's trained targets of its global batch (fine-tuning samples; token_weight)."""
        self.last_step_tokens: int | None = None
        """...and the last step's, for its StepStats."""
        self.pipeline = self._build_pipeline() if layout.pp > 1 else None
        """Pipeline parallelism: the schedule that runs this rank's stages (parallel/pipeline.py)."""
        self.sampler = batches
        """Anything with next_batch() -> (inputs, targets) of one micro-batch."""
        self.steps_done = 0
        """Optimizer steps taken (a resumed run's start included): the next step is steps_done + 1."""
        self.skipped_steps = 0
        """Steps fp16 loss scaling skipped (inf/nan gradients)."""
        set_attention_backend(model, cfg.training.attention_backend)

    def build_grad_scaler(self) -> torch.amp.GradScaler:
        """The loss scaler (fp16: dynamic scaling; otherwise a disabled one). Subclasses may wrap it."""
        return grad_scaler(self.policy, self.model, self.optimizer, pipelined=self.layout.pp > 1)

    def _build_pipeline(self) -> PipelineStep:
        """The schedule of this rank's stages, with the loss it computes on the last stage: each
        micro-batch's language-model loss (kept in `pipeline_losses` for the report) over the
        micro-batches, scaled under fp16; MoE stages add their auxiliary losses' gradients."""
        m = self.layout.num_microbatches

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            lm_loss = self.lm_loss(logits, targets)
            if self.step_tokens:  # the mean over the step's trained targets (token_weight)
                local = (targets != IGNORE).sum() * (self.world.dp_size * self.layout.cp / self.step_tokens)
                self.pipeline_losses.append(lm_loss.detach() * local * m)  # the report divides by m
                return self.scaler.scale(lm_loss) * local
            self.pipeline_losses.append(lm_loss.detach())
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

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, language-model loss to report) of one micro-batch's forward; `documents`:
        packed rows' document ids (train/packing.py; never under context or pipeline parallelism)."""
        sequence = self.model.sequence  # context parallelism: this rank's chunks of each row
        inputs, targets = sequence.shard(inputs), sequence.shard(targets)
        with self.autocast():  # the chunked loss projects the logits, in the forward's precision
            output = self.model(inputs) if documents is None else self.model(inputs, documents)
            lm_loss = self.lm_loss(output, targets)
        aux = getattr(self.model, "aux_loss", None)
        if aux is not None and self.cfg.model.num_experts:
            return lm_loss + self.cfg.model.router_aux_loss_coef * aux, lm_loss
        return lm_loss, lm_loss

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, num_microbatches: int,
                         sync_gradients: bool, step_tokens: int | None = None,
                         documents: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch of an optimizer step of `num_microbatches`: forward, loss, scaled
        backward; gradients accumulate. `sync_gradients`: reduce them across data-parallel ranks
        now (the step's last micro-batch). Returns the language-model loss (detached). `step_tokens`:
        the trained targets of the step's global batch (fine-tuning samples: `token_weight`); `documents`:
        packed rows' document ids."""
        set_gradient_sync(self.model, sync_gradients)
        self._moment("forward")
        with self.loss_context():
            loss, lm_loss = self.loss(inputs, targets, documents)
            self._moment("backward")
            weight = self.token_weight(targets, step_tokens) if step_tokens else 1 / num_microbatches
            self.scaler.scale(loss * weight).backward()
        return lm_loss.detach() * (weight * num_microbatches if step_tokens else 1)

    def token_weight(self, targets: torch.Tensor, step_tokens: int) -> torch.Tensor:
        """A micro-batch's share of the step's loss when the step's loss is the mean over the trained
        targets of its whole global batch (`step_tokens`): its own mean times its trained targets (this
        rank's shard of them under context parallelism) over the step's, times the ranks the gradient
        reduction averages over (data-parallel and context-parallel), so that their average is the mean
        over every trained target, whatever the micro-batches, accumulation and ranks. Padded rows and
        masked prompts make the micro-batches' counts unequal, where a mean of means would weigh a
        micro-batch of few trained targets as much as one of many."""
        local = (self.model.sequence.shard(targets) != IGNORE).sum()
        return local * (self.world.dp_size * self.layout.cp / step_tokens)

    def pipeline_forward_backward(self) -> torch.Tensor:
        """The step's micro-batches through the pipeline schedule (forward, loss on the last stage,
        backward, in the schedule's order). Returns the sum of their language-model losses on the
        ranks of the last stage, 0 elsewhere."""
        assert self.pipeline is not None
        self.step_tokens = self.last_step_tokens = self._step_tokens()
        batches = [self.sampler.next_batch() for _ in range(self.layout.grad_accum_steps)]
        sequence = self.model.sequence  # context parallelism: this rank's chunks of each row
        inputs, targets = (sequence.shard(torch.cat(parts)).to(self.device) for parts in zip(*batches, strict=True))
        self.pipeline_losses.clear()
        self.scaler.scale(torch.zeros((), device=self.device))  # fp16: sets the scale where no loss is computed
        with self.autocast(), self.loss_context():
            self.pipeline.run(inputs, targets)
        self.step_tokens = None  # evaluation's forwards take plain means
        losses = self.pipeline_losses
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    def _step_tokens(self) -> int | None:
        """The trained targets of the coming step's global batch where the sampler counts them (fine-tuning
        samples, train/samples.py), else None (text: every target trained, the micro-batches alike)."""
        count = getattr(self.sampler, "step_trained_tokens", None)
        return count() if count is not None else None

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

    def __call__(self) -> StepStats:
        """One optimizer step over `grad_accum_steps` micro-batches of this rank's rows."""
        compiles = _compile_events()
        start = time.perf_counter()
        accum = self.layout.grad_accum_steps
        total = torch.zeros((), device=self.device)
        if self.pipeline is not None:
            total += self.pipeline_forward_backward()
            step_tokens = self.last_step_tokens
        else:
            step_tokens = self._step_tokens()
            for i in range(accum):
                inputs, targets, *documents = (t.to(self.device, non_blocking=True) for t in self.sampler.next_batch())
                total += self.forward_backward(inputs, targets, num_microbatches=accum, sync_gradients=i == accum - 1,
                                               step_tokens=step_tokens, documents=documents[0] if documents else None)
        # A text micro-batch holds micro_batch_size x seq_len trained tokens (no padding), so the mean over
        # all tokens of the global batch is the mean of the micro-batch means over all ranks (under
        # pipeline parallelism, the ranks of the last stage: the others add 0); fine-tuning samples' are
        # weighted by their trained targets (token_weight), which makes it the same mean.
        loss_value = self.world.sum_(total).item() / (accum * self.world.size // self.layout.pp)
        if not math.isfinite(loss_value) and not self.policy.uses_loss_scaling:  # the same on every rank
            raise TrainingDiverged(
                f"step {self.steps_done + 1}: the loss is {loss_value}; stopping without saving "
                f"(the last good checkpoint in {self.cfg.checkpoint.dir!r} is kept). Lower training.lr, "
                "enable training.grad_clip, or use bf16-mixed instead of a pure low-precision mode")
        grad_norm, skipped, lr = self.optimizer_step()
        self.steps_done += 1
        return StepStats(loss_value, grad_norm, skipped, time.perf_counter() - start, lr,
                         compiled=_compile_events() != compiles, trained_tokens=step_tokens)


def _compile_events() -> int:
    """How many compilations torch.compile has timed in this process (dynamo frames, inductor's
    forward and backward graphs): a step that changes it compiled something."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(len(times) for times in compilation_time_metrics.values())
