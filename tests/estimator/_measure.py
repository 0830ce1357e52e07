"""Measure one real training step of our own models, per phase and per component (CPU allocator).

The step is trainfit's own: a `Trainer` (model, activation checkpointing, precision, optimizer,
GradScaler, data) runs `train_step()` unchanged; only two instance attributes are wrapped to mark
the phase boundaries: `_loss` (forward + loss) and `scaler.unscale_` (first call of the optimizer
phase: unscale, clip, step, zero_grad). In-use C-heap bytes are sampled after every aten
operator, as `trainfit.memory.measure.measure_peak` does.

- activations: in use after forward + loss minus in use before the forward (first micro-batch)
- params / grads / optimizer / module buffers: bytes of the tensors themselves (unique storages)
- peak and phase_peaks: the step's largest growth above its start, plus the tensors alive at its
  start (parameters, optimizer states, module buffers; gradients are None there).

Counting the start from tensors, not from the heap before the model was built (what `trainfit
train` reports), leaves out library memory: BLAS/OpenMP buffers and the first dispatch mode's
imports (~11 MiB in a fresh process, so `trainfit train` shows ~232 MiB where its step peaks at
~221 MiB). oneDNN, which runs CPU bf16/fp16 matmuls, also caches kernels per GEMM shape in the C
heap: 5-11 MiB more per step for an MoE, whose per-expert token counts change every step, until
its cache fills (dense models reuse their shapes after the warm-up step). So an MoE in 16-bit
runs with `torch.backends.mkldnn` disabled: the tensors are the same, and the heap then holds the
step's tensors only, as `torch.cuda.max_memory_allocated` does on a GPU (disabling it everywhere
would make every step 5-10x slower).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainfit.config import Config, load_config
from trainfit.memory import measure
from trainfit.train.trainer import Trainer


@dataclass
class MeasuredStep:
    params: int
    grads: int
    optimizer: int
    activations: int
    """In use after the forward and the loss, minus before the forward."""
    peak: int
    phase_peaks: dict[str, int] = field(default_factory=dict)
    module_buffers: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer


class _PhaseSampler(TorchDispatchMode):
    """In-use C-heap bytes after every aten operator, maximum kept per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.peaks: dict[str, int] = {}

    def sample(self) -> int:
        used = measure._cpu_in_use_bytes()
        if used > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = used
        return used

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


@contextmanager
def _mkldnn(enabled: bool) -> Iterator[None]:
    # flags() (not the attribute): torch.testing._internal freezes global flags when imported.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "TF32 acceleration on top of oneDNN")  # said on every flags() call
        with torch.backends.mkldnn.flags(enabled=enabled):
            yield


def config(run_dir: Path, *overrides: str) -> Config:
    """A config that trains quietly under run_dir (no eval, no checkpoint, no progress bar)."""
    base = ["--training.eval_interval=0", "--checkpoint.interval=0", "--checkpoint.resume=never",
            f"--checkpoint.dir={run_dir / 'ckpt'}", f"--logging.dir={run_dir / 'logs'}",
            "--logging.progress=false", "--training.device=cpu"]
    return load_config(None, [*base, *overrides])


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextmanager
def one_thread() -> Iterator[None]:
    """These steps are tiny: a second intra-op thread gains nothing, and on a shared machine
    oversubscribed OpenMP threads spin (3-30x slower steps). The tensors are the same."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def measure_step(cfg: Config, warmup_steps: int = 1) -> MeasuredStep:
    """Build trainfit's Trainer for `cfg`, run `warmup_steps` plain steps, then one measured step."""
    with one_thread():
        return _measure_step(cfg, warmup_steps)


def _measure_step(cfg: Config, warmup_steps: int) -> MeasuredStep:
    gc.collect()
    trainer = Trainer(cfg)
    onednn = not (cfg.model.num_experts and cfg.precision.mode != "fp32")
    with _mkldnn(onednn):
        for _ in range(warmup_steps):  # optimizer states exist, one-time library buffers are allocated
            trainer.train_step()
    gc.collect()
    measure._prime_dispatch_mode()
    sampler = _PhaseSampler()
    marks: dict[str, int] = {}
    states = [t for state in trainer.optimizer.state.values() for t in state.values()]
    at_start = _storage_bytes([*trainer.model.parameters(), *trainer.model.buffers(), *states])
    original_loss, original_unscale = trainer._loss, trainer.scaler.unscale_

    def loss(inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        sampler.phase = "forward"
        before = sampler.sample()
        out = original_loss(inputs, targets)
        after = sampler.sample()
        marks.setdefault("activations", after - before)
        sampler.phase = "backward"
        return out

    def unscale(optimizer: torch.optim.Optimizer) -> None:
        marks["grads"] = _storage_bytes(p.grad for p in trainer.model.parameters())
        sampler.phase = "optimizer"
        original_unscale(optimizer)

    trainer._loss, trainer.scaler.unscale_ = loss, unscale  # type: ignore[method-assign]
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with _mkldnn(onednn), sampler:
            start = sampler.sample()
            trainer.train_step()
            sampler.sample()
    finally:
        if was_enabled:
            gc.enable()
        trainer._loss, trainer.scaler.unscale_ = original_loss, original_unscale  # type: ignore[method-assign]
    phase_peaks = {phase: used - start + at_start for phase, used in sampler.peaks.items()}
    return MeasuredStep(
        params=_storage_bytes(trainer.model.parameters()),
        grads=marks["grads"],
        optimizer=_storage_bytes(states),
        module_buffers=_storage_bytes(trainer.model.buffers()),
        activations=marks["activations"],
        peak=max(phase_peaks.values()),
        phase_peaks=phase_peaks,
    )


# ---------------------------------------------------------------- the accuracy grid

SHAPES: dict[str, tuple[str, ...]] = {
    # dense Llama, multi-head attention
    "llama": ("--model.preset=", "--model.family=llama", "--model.dim=128", "--model.num_layers=3",
              "--model.num_heads=4", "--model.num_kv_heads=4", "--model.ffn_dim=352", "--model.vocab_size=512",
              "--model.max_seq_len=256"),
    # grouped-query attention (the `tiny` preset's layout, 2 layers)
    "gqa": ("--model.preset=tiny", "--model.num_layers=2", "--model.ffn_dim=512"),
    # routed + shared experts
    "moe": ("--model.preset=debug-moe", "--model.dim=128", "--model.expert_ffn_dim=128", "--model.max_seq_len=256"),
    # GPT-2 block (LayerNorm, biases, GELU), tied output
    "gpt2": ("--model.preset=debug-gpt2", "--model.dim=128", "--model.num_layers=3", "--model.ffn_dim=512",
             "--model.vocab_size=512", "--model.max_seq_len=256"),
    # Llama with a tied, large-ish vocabulary (logits matter)
    "tied": ("--model.preset=", "--model.family=llama", "--model.dim=192", "--model.num_layers=2",
             "--model.num_heads=6", "--model.num_kv_heads=2", "--model.ffn_dim=512", "--model.vocab_size=2048",
             "--model.max_seq_len=256", "--model.tie_embeddings=true"),
}

# (shape, precision, optimizer, checkpointing, micro-batch, seq_len[, extra overrides])
GRID: list[tuple] = [
    ("llama", "fp32", "adamw", "none", 8, 128),
    ("llama", "bf16-mixed", "adamw", "none", 8, 128),
    ("llama", "fp16-mixed", "adam", "none", 4, 128),
    ("llama", "bf16-pure", "sgd", "none", 8, 64),
    ("llama", "fp32", "sgd", "selective", 8, 128),
    ("llama", "bf16-mixed", "adam", "full", 16, 64),
    ("llama", "bf16-pure", "adamw", "full", 8, 128),
    ("llama", "fp32", "adamw", "full", 4, 256, "--training.global_batch_size=8"),
    ("gqa", "fp32", "adamw", "none", 4, 128),
    ("gqa", "bf16-mixed", "sgd", "selective", 4, 128),
    ("gqa", "fp16-mixed", "adamw", "full", 8, 64),
    ("gqa", "bf16-pure", "adam", "selective", 4, 128),
    ("gqa", "bf16-mixed", "adamw", "none", 2, 256),
    ("gqa", "fp32", "adam", "selective", 2, 128, "--memory.ac_every_n_layers=2"),
    ("moe", "fp32", "adamw", "none", 8, 128),
    ("moe", "bf16-mixed", "adamw", "none", 8, 64),
    ("moe", "bf16-pure", "sgd", "none", 8, 128),
    ("moe", "fp32", "adam", "selective", 8, 128),
    ("moe", "fp16-mixed", "sgd", "full", 8, 128),
    ("moe", "bf16-mixed", "adam", "selective", 4, 128),
    ("gpt2", "fp32", "adamw", "none", 8, 128),
    ("gpt2", "bf16-mixed", "adam", "none", 4, 128),
    ("gpt2", "fp16-mixed", "adamw", "selective", 8, 64),
    ("gpt2", "bf16-pure", "adamw", "none", 8, 128),
    ("gpt2", "fp32", "sgd", "full", 8, 128),
    ("gpt2", "bf16-mixed", "sgd", "full", 16, 64),
    ("gpt2", "bf16-pure", "adam", "selective", 4, 256),
    ("tied", "fp32", "adamw", "none", 4, 128),
    ("tied", "bf16-mixed", "adamw", "selective", 4, 128),
    ("tied", "fp16-mixed", "adam", "none", 4, 64),
    ("tied", "bf16-pure", "sgd", "full", 8, 64),
    ("tied", "fp32", "sgd", "none", 2, 128, "--training.global_batch_size=4"),
    ("tied", "bf16-mixed", "adamw", "full", 8, 128, "--memory.ac_every_n_layers=2"),
]


def grid_name(row: tuple) -> str:
    shape, precision, optimizer, ac, micro, seq, *extra = row
    name = f"{shape}-{precision}-{optimizer}-{ac}-b{micro}-s{seq}"
    return name + "".join("-" + e.split(".", 1)[1] for e in extra)


def grid_overrides(row: tuple) -> list[str]:
    shape, precision, optimizer, ac, micro, seq, *extra = row
    return [*SHAPES[shape], f"--precision.mode={precision}", f"--optimizer.name={optimizer}",
            f"--memory.activation_checkpointing={ac}", f"--training.micro_batch_size={micro}",
            f"--training.global_batch_size={micro}", f"--training.seq_len={seq}", *extra]
