"""Memory of a real training step, measured at the allocator and attributed to components.

`MemoryMeter.measure(trainer)` runs `Trainer.train_step` unchanged (a step listener,
`Trainer.listening`, marks the phases, as in the traced estimator) and reports, for this rank:

- peak, phase_peaks and the timeline: the tensor bytes alive when the step starts (counted
  exactly by `StorageLedger`, memory/ledger.py) plus the allocator's growth since then: CPU,
  glibc's in-use bytes read after every aten operator, every collective waited for first so that
  gloo's threads' scratch is gone (memory/measure.py); CUDA,
  `memory_allocated` per operator and `max_memory_allocated` for the peak. The step's own
  allocations are the allocator's figures; what was allocated before and is no tensor (math
  libraries' caches, oneDNN's bf16 kernels and workspaces on CPU, the first dispatch mode's
  imports, Python and autograd objects: up to ~10 MiB on a small CPU run) is `reserved_margin`, shown
  apart: in use at the step's start, above `trainer.memory_floor` (before the model was built),
  beyond the tensors alive then. `trainfit train` reports this peak (Trainer.measured_step).
- the components at the operator where the allocator peaked: the ledger, run on the real
  tensors, gives params, master_params, grads, optimizer, activations and logits (live storages,
  deduplicated; the same rules as the traced estimate); buffers = peak - all of those, so it also
  holds what no tensor explains (allocator overhead, autograd's graph objects, tensor headers).
- two cross-checks computed without the ledger: `forward_retained` (allocator in use right after
  the first micro-batch's forward + loss, minus right before: what analytic.forward_retained_bytes
  predicts) and `state_bytes` (the model states counted from the trainer's tensors once every
  gradient is in, parallel/data_parallel.local_state_bytes).

The ledger finds parameters, gradients and optimizer states by itself; tensors held elsewhere
(DDP's gradient buckets, built at the first step and rebuilt at the second, held in C++) it
knows only if it saw them created. So one meter serves a trainer for its whole life and also
*watches* steps (`MemoryMeter.watch`: the ledger without allocator sampling): the trainer's loop
watches its first step and measures its second, as `measure_trainer_step(trainer, warmup_steps=1)`
does; a tensor created by an unwatched step counts in reserved_margin, not in the peak.

Under torchrun every rank measures itself; nothing is gathered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainfit.memory import measure
from trainfit.memory.breakdown import COMPONENTS, PHASES, MemoryBreakdown
from trainfit.memory.ledger import StorageLedger, TimelinePoint, phase_listener, unsharded_component
from trainfit.parallel.data_parallel import local_state_bytes
from trainfit.parallel.layout import Layout

if TYPE_CHECKING:  # the trainer builds its meter from this module
    from trainfit.train.trainer import StepStats, Trainer

_CUDA_HISTORY_ENTRIES = 100_000


@dataclass
class Measurement:
    breakdown: MemoryBreakdown
    """Components at the allocator's peak (buffers = peak - the others), phase and phase peaks."""
    timeline: list[TimelinePoint]
    """In-use bytes (as `peak` counts them) after every operator of the step."""
    peak_module: str
    forward_retained: int
    """Allocated after the first micro-batch's forward + loss, minus before it."""
    tracked_peak: int
    """The largest sum of live tensor storages the ledger saw (no allocator overhead)."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """The trainer's own count of params / grads / optimizer bytes after backward."""
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the breakdown's fields, the cross-checks, the timeline as lists."""
        out = dataclasses.asdict(self)
        out["timeline"] = [list(point) for point in self.timeline]
        return out


class _Probe:
    """Reads the allocator after every operator; keeps the maximum and pins the ledger there.

    Figures are the step's allocator growth (in use now - in use at the step's start) on top of
    the tensor bytes alive at the start (`base`, counted exactly by the ledger)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0
        self.base = 0
        self.ledger: StorageLedger | None = None
        self.peak = -1
        self.phase_peaks: dict[str, int] = {}
        self.phase = ""
        self.module = ""
        self.timeline: list[TimelinePoint] = []

    def begin(self, ledger: StorageLedger) -> None:
        self.ledger = ledger
        self.start = measure.current_allocated_bytes(self.device)
        self.base = ledger.total

    def read(self) -> int:
        return measure.current_allocated_bytes(self.device) - self.start + self.base

    def __call__(self, op: int) -> None:
        ledger = self.ledger
        if ledger is None:
            return
        used = self.read()
        self.timeline.append((op, used, ledger.phase, ledger.timeline[-1][3] if ledger.timeline else ""))
        if used > self.phase_peaks.get(ledger.phase, -1):
            self.phase_peaks[ledger.phase] = used
        if used > self.peak:
            self.peak, self.phase, self.module = used, ledger.phase, ledger.module()
            ledger.pin("allocator")


@contextlib.contextmanager
def cuda_history(path: Path | None) -> Iterator[None]:
    """CUDA only: record allocator history and dump a snapshot (pytorch.org/memory_viz) to `path`."""
    if path is None:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=_CUDA_HISTORY_ENTRIES)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


class MemoryMeter:
    """One trainer's StorageLedger, kept for the trainer's life and entered only for the steps
    it watches or measures (see the module docstring); it holds no reference to the trainer."""

    def __init__(self, device: torch.device, layout: Layout) -> None:
        self.ledger = StorageLedger(fake=False, unsharded_component=unsharded_component(layout),
                                    device_type=device.type)

    @contextlib.contextmanager
    def _watching(self, trainer: Trainer, on_forward: Callable[[str], None] | None = None) -> Iterator[StorageLedger]:
        ledger = self.ledger
        with ledger, trainer.listening(phase_listener(ledger, trainer, on_forward)):
            ledger.watch_model(trainer.model, split_backward=trainer.layout.splits_backward)
            ledger.grad_hooks(list(trainer.model.parameters()))
            try:
                yield ledger
            finally:
                ledger.in_loss = False

    def watch(self, trainer: Trainer) -> StepStats:
        """`trainer.train_step()` with the ledger recording the tensors it creates (~15% slower)."""
        with self._watching(trainer):
            return trainer.train_step()

    def measure(self, trainer: Trainer, *, cuda_snapshot: str | Path | None = None) -> tuple[StepStats, Measurement]:
        """`trainer.train_step()` measured on this rank: the step's own stats and its measurement.
        `cuda_snapshot`: on CUDA, also write the allocator's memory snapshot (pytorch.org/memory_viz)."""
        device = trainer.device
        serial = contextlib.nullcontext() if device.type == "cuda" else measure.collectives_completed()
        if device.type != "cuda":
            measure._prime_dispatch_mode()
        probe = _Probe(device)
        marks: dict[str, int] = {}

        def on_forward(moment: str) -> None:
            if probe.ledger is not None:
                marks.setdefault(moment, measure.current_allocated_bytes(device))

        state_bytes: dict[str, int] = {}

        def count_states(moment: str) -> None:
            if moment == "update":  # every gradient in, unscaled and clipped; the optimizer not yet stepped
                state_bytes.update(local_state_bytes(trainer.model, trainer.optimizer))

        self.ledger.on_sample = probe
        try:
            # CPU: below the ledger, so that it samples after a collective has completed (measure.py).
            with serial, self._watching(trainer, on_forward) as ledger, trainer.listening(count_states):
                stats = _sampled_step(trainer, ledger, probe, cuda_snapshot)
                ledger.classify(trainer.model, trainer.optimizer, trainer.policy)
        finally:
            self.ledger.recording, self.ledger.on_sample = False, None
        breakdown = self._breakdown(probe, reserved_margin=max(0, probe.start - trainer.memory_floor - probe.base))
        return stats, Measurement(breakdown=breakdown, timeline=probe.timeline, peak_module=probe.module,
                                  forward_retained=marks["end"] - marks["start"], tracked_peak=self.ledger.peak,
                                  state_bytes=state_bytes, rank=trainer.world.rank,
                                  world_size=trainer.world.size, device=str(device))

    def _breakdown(self, probe: _Probe, *, reserved_margin: int) -> MemoryBreakdown:
        """The ledger's components at the allocator's peak; buffers = the rest of the peak."""
        at_peak = self.ledger.pins.get("allocator", (0, dict.fromkeys(COMPONENTS, 0)))[1]
        self.ledger.timeline = []  # the probe keeps the step's own; the ledger's would live on with the trainer
        parts = {name: at_peak[name] for name in COMPONENTS if name != "buffers"}
        return MemoryBreakdown(**parts, buffers=probe.peak - sum(parts.values()), peak=probe.peak,
                               peak_phase=probe.phase, reserved_margin=reserved_margin,
                               phase_peaks={p: probe.phase_peaks[p] for p in PHASES if p in probe.phase_peaks})


def _sampled_step(trainer: Trainer, ledger: StorageLedger, probe: _Probe,
                  cuda_snapshot: str | Path | None) -> StepStats:
    """One train step with the probe reading the allocator from a clean start (garbage collected,
    then the collector paused; model states classified; CUDA's peak statistics reset)."""
    cuda = trainer.device.type == "cuda"
    gc.collect()
    with measure.gc_paused(), cuda_history(Path(cuda_snapshot) if cuda and cuda_snapshot else None):
        ledger.classify(trainer.model, trainer.optimizer, trainer.policy, others="buffers")
        if cuda:
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        probe.begin(ledger)
        ledger.reset_peak()
        stats = trainer.train_step()
        if cuda:
            torch.cuda.synchronize(trainer.device)
            probe.peak = max(probe.peak, torch.cuda.max_memory_allocated(trainer.device) - probe.start + probe.base)
    return stats


def measure_trainer_step(trainer: Trainer, *, warmup_steps: int = 0,
                         cuda_snapshot: str | Path | None = None) -> Measurement:
    """Run `warmup_steps` watched steps, then measure one more `trainer.train_step()` on this rank.

    The trainer must have stepped at least once before the measured step (optimizer states and
    one-time library buffers would otherwise count): pass warmup_steps=1 to a fresh Trainer.
    Tensors created during the warm-up, or during earlier `Trainer.watched_step`s, are known to the
    ledger (DDP's gradient buckets, the loss scaler's state); other such tensors count in
    reserved_margin, not in the peak.
    `cuda_snapshot`: on CUDA, also write the allocator's memory snapshot (pytorch.org/memory_viz)."""
    for _ in range(warmup_steps):
        trainer.watched_step()
    return trainer.memory_meter.measure(trainer, cuda_snapshot=cuda_snapshot)[1]
