"""The training loop: build (meta device) -> checkpointing policy -> materialize -> resume -> steps.

Single process for now; every piece (data sampler ranks, DCP checkpoints) is already shaped for
the data-parallel ranks that parallel/apply.py will add.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainfit.config import Config, ConfigError, config_to_dict
from trainfit.hardware import peak_flops
from trainfit.memory.measure import current_allocated_bytes, measure_peak
from trainfit.models import build_model, count_params, materialize
from trainfit.perf.flops import mfu, training_flops_per_token
from trainfit.precision import precision_policy, step_optimizer
from trainfit.recompute import apply_activation_checkpointing
from trainfit.train import checkpoint as ckpt
from trainfit.train.data import BatchSampler, eval_batches, resolve_data
from trainfit.train.metrics import MetricsWriter
from trainfit.train.optim import build_optimizer, build_scheduler
from trainfit.train.progress import TrainProgress
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
    peak_memory_bytes: int | None = None


@dataclass
class TrainResult:
    steps_done: int
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: int | None = None
    skipped_steps: int = 0
    stopped_by_signal: bool = False
    checkpoint: Path | None = None
    num_params: int = 0


def check_single_process(cfg: Config) -> None:
    """Fail fast on options that multi-process training (parallel/) will bring, not this loop."""
    p = cfg.parallel
    degrees = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp, "pp": p.pp,
               "cp": p.cp, "ep": p.ep}
    for name, degree in degrees.items():
        if degree != 1:
            raise ConfigError(f"parallel.{name}={degree}: `trainfit train` runs one process for now; "
                              f"set parallel.{name}=1 (multi-process parallelism is not built yet)")
    if p.zero_stage:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: needs several data-parallel ranks; set it to 0")
    if cfg.memory.offload != "none":
        raise ConfigError(f"memory.offload={cfg.memory.offload!r}: not yet supported by `trainfit train`; "
                          "set it to none")
    if cfg.memory.chunked_loss:
        raise ConfigError("memory.chunked_loss=true: not yet supported by `trainfit train`; set it to false")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device='cuda': no CUDA device is available; use auto or cpu")
    return torch.device(name)


def data_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainfit" / "data"


class Trainer:
    def __init__(self, cfg: Config) -> None:
        check_single_process(cfg)
        self.cfg = cfg
        self.device = resolve_device(cfg.training.device)
        self.policy = precision_policy(cfg.precision.mode, self.device.type)
        self.data = resolve_data(cfg.data, str(data_cache_dir()))
        if self.data.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size={cfg.model.vocab_size}: smaller than the tokenizer's vocabulary "
                f"({self.data.tokenizer.vocab_size}); raise model.vocab_size or use a smaller tokenizer")
        self.memory_floor = current_allocated_bytes(self.device)
        torch.manual_seed(cfg.training.seed)
        self.model = build_model(cfg.model)
        self.num_params = count_params(self.model)
        apply_activation_checkpointing(self.model, cfg.memory.activation_checkpointing,
                                       cfg.memory.ac_every_n_layers)
        materialize(self.model, self.device)
        self.policy.prepare_model(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, cfg.training, self.device.type)
        self.scheduler = build_scheduler(self.optimizer, cfg.training)
        self.scaler = self.policy.make_grad_scaler()
        t = cfg.training
        self.sampler = BatchSampler(self.data.train, t.seq_len, t.micro_batch_size, t.seed,
                                    grad_accum_steps=cfg.grad_accum_steps)
        self.flops_per_token = training_flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = peak_flops(cfg.hardware, cfg.precision.mode)
        self.step = 0
        self.skipped_steps = 0
        self.resumed_from = self._maybe_resume()

    # ------------------------------------------------------------ state

    def _maybe_resume(self) -> Path | None:
        spec = self.cfg.checkpoint.resume
        if spec == "never":
            return None
        path = ckpt.latest_checkpoint(self.cfg.checkpoint.dir) if spec == "auto" else ckpt.resolve_checkpoint(spec)
        if path is None:
            return None
        state = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        return path

    def save(self) -> Path:
        state = {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": ckpt.rng_state(),
        }
        return ckpt.save_checkpoint(self.cfg.checkpoint.dir, self.step, self.model, self.optimizer, state,
                                    config_to_dict(self.cfg), write_extras=self.data.tokenizer.save,
                                    keep_last=self.cfg.checkpoint.keep_last)

    # ------------------------------------------------------------ step

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss to backpropagate, language-model loss to report)."""
        with self.policy.autocast():
            logits = self.model(inputs)
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        aux = getattr(self.model, "aux_loss", None)
        if aux is not None and self.cfg.model.num_experts:
            return lm_loss + self.cfg.model.router_aux_loss_coef * aux, lm_loss
        return lm_loss, lm_loss

    def train_step(self) -> StepStats:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        start = time.perf_counter()
        accum = self.cfg.grad_accum_steps
        total = torch.zeros((), device=self.device)
        for _ in range(accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in self.sampler.next_batch())
            loss, lm_loss = self._loss(inputs, targets)
            self.scaler.scale(loss / accum).backward()
            total += lm_loss.detach()
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.training.grad_clip or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        loss_value = total.item() / accum
        uses_scaling = self.policy.uses_loss_scaling
        if not math.isfinite(loss_value) and not uses_scaling:
            raise TrainingDiverged(
                f"step {self.step + 1}: the loss is {loss_value}; stopping without saving "
                f"(the last good checkpoint in {self.cfg.checkpoint.dir!r} is kept). Lower training.lr, "
                "enable training.grad_clip, or use bf16-mixed instead of a pure low-precision mode")
        skipped = not step_optimizer(self.optimizer, self.scaler)
        self.skipped_steps += int(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.step += 1
        return StepStats(loss_value, float(grad_norm), skipped, time.perf_counter() - start, lr)

    def measured_step(self) -> StepStats:
        """A train step with the allocator sampled per operator (slower: not every step)."""
        with measure_peak(self.device) as mem:
            stats = self.train_step()
        stats.peak_memory_bytes = mem.baseline_bytes + mem.peak_bytes - self.memory_floor
        return stats

    @torch.no_grad()
    def evaluate(self) -> float:
        t = self.cfg.training
        self.model.eval()
        losses = []
        for inputs, targets in eval_batches(self.data.val, t.seq_len, t.micro_batch_size, t.eval_steps):
            losses.append(self._loss(inputs.to(self.device), targets.to(self.device))[1].item())
        self.model.train()
        return sum(losses) / len(losses)

    # ------------------------------------------------------------ loop

    def _is_measured(self, step: int) -> bool:
        interval = self.cfg.logging.memory_interval
        first = min(2, self.cfg.training.steps)
        return step == first or (interval > 0 and step % interval == 0)

    def train(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.training
        result = TrainResult(steps_done=self.step, num_params=self.num_params,
                             skipped_steps=self.skipped_steps, checkpoint=self.resumed_from)
        writer = MetricsWriter(cfg.logging.dir, resume_step=self.step, tensorboard=cfg.logging.tensorboard)
        tokens_per_step = t.global_batch_size * t.seq_len
        window_tokens, window_seconds = 0, 0.0
        last_saved = self.step if self.resumed_from else None
        try:
            with StopOnSignal() as stop, TrainProgress(t.steps, self.step, cfg.logging.progress) as bar:
                if self.step == 0 and t.eval_interval:
                    result.val_losses[0] = self._log_eval(writer, bar)
                while self.step < t.steps and not stop.requested:
                    stats = self.measured_step() if self._is_measured(self.step + 1) else self.train_step()
                    result.losses[self.step] = stats.loss
                    result.peak_memory_bytes = stats.peak_memory_bytes or result.peak_memory_bytes
                    window_tokens += tokens_per_step
                    window_seconds += stats.seconds
                    tokens_per_s = window_tokens / window_seconds
                    bar.update(self.step, stats.loss, tokens_per_s)
                    if self.step % cfg.logging.interval == 0 or self.step == t.steps:
                        result.tokens_per_s = tokens_per_s
                        result.mfu = mfu(tokens_per_s, self.flops_per_token, self.peak_flops)
                        writer.write(self._record(stats, tokens_per_s, result))
                        window_tokens, window_seconds = 0, 0.0
                    if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.steps):
                        result.val_losses[self.step] = self._log_eval(writer, bar)
                    if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                        result.checkpoint, last_saved = self.save(), self.step
                result.stopped_by_signal = stop.requested
                if stop.requested:
                    bar.note(f"received {stop.signal_name}: saving a checkpoint at step {self.step}")
            if last_saved != self.step:
                result.checkpoint = self.save()
        finally:
            writer.close()
        result.steps_done = self.step
        result.skipped_steps = self.skipped_steps
        return result

    def _record(self, stats: StepStats, tokens_per_s: float, result: TrainResult) -> dict[str, Any]:
        record: dict[str, Any] = {
            "step": self.step,
            "loss": stats.loss,
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": result.mfu,
            "peak_memory_bytes": result.peak_memory_bytes,
        }
        if self.policy.uses_loss_scaling:
            record["loss_scale"] = self.scaler.get_scale()
            record["skipped_steps"] = self.skipped_steps
        return record

    def _log_eval(self, writer: MetricsWriter, bar: TrainProgress) -> float:
        val_loss = self.evaluate()
        writer.write({"step": self.step, "val_loss": val_loss})
        bar.note(f"step {self.step}: val loss {val_loss:.4f}")
        return val_loss
