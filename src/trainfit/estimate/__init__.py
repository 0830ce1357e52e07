"""`trainfit estimate`: per-rank memory, FLOPs, step time and MFU of a config, in closed form.

Pure arithmetic, no torch import: the answer comes in milliseconds and the planner can call it
thousands of times a second. The JSON schema (plan/answer_schema.py documents it) is the dict `as_json` returns:
keys model, per_rank, per_stage, flops, time, fits, attention_kernel.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from trainfit.config import Config
from trainfit.hardware import device_spec, device_type
from trainfit.memory import MemoryBreakdown
from trainfit.memory.closed_form import MemoryEstimate, assumed_attention_kernel, estimate_memory
from trainfit.models.architecture import describe, softcap_kernel
from trainfit.models.params import param_counts
from trainfit.parallel.layout import Layout
from trainfit.parallel.resolve import build_layout
from trainfit.perf.engines import TRAINFIT_ENGINE, Engine
from trainfit.perf.timing import PerfEstimate, Rates, compute_time_s, estimate_perf

GIB = 1024**3


@dataclass(frozen=True)
class Estimate:
    cfg: Config
    layout: Layout
    memory: MemoryEstimate
    perf: PerfEstimate
    device_memory: int

    @property
    def worst(self) -> MemoryBreakdown:
        return self.memory.per_stage[self.memory.worst_stage]

    def total_bytes(self, stage: MemoryBreakdown) -> int:
        """What the device must hold: the peak plus the margin shown apart."""
        return stage.peak + stage.reserved_margin

    @functools.cached_property
    def memory_bytes(self) -> int:
        """What the busiest pipeline rank's device must hold (total_bytes of its stage)."""
        return max(self.total_bytes(s) for s in self.memory.per_stage)

    @property
    def attention_kernel(self) -> str:
        """"fused" or "math": the attention kernel the memory estimate assumes (analytic.py)."""
        return assumed_attention_kernel(self.cfg.model, self.layout, self.cfg.training, self.cfg.hardware)

    def attention_note(self) -> str:
        """Which attention kernel the estimate assumes, and why, in one line."""
        backend = self.cfg.training.attention_backend
        if describe(self.cfg.model).attention.sinks:
            return ("attention: attention sinks (model.attention_sinks) run an eager attention on every device, not "
                    "SDPA: heads x seq x (seq + 1) fp32 probabilities saved per block")
        if describe(self.cfg.model).attention.softcap:
            if softcap_kernel(device_type(self.cfg.hardware)) == "flex":
                return ("attention: soft-capped scores (model.attention_softcap) run FlexAttention, compiled: no seq "
                        "x seq term (priced at FlashAttention-2's rates, its own not measured)")
            return ("attention: soft-capped scores (model.attention_softcap) run an eager attention, not SDPA: "
                    "heads x seq x seq scores and fp32 probabilities saved per block")
        why = "torch's choice for these inputs" if backend == "auto" else "asked"
        if self.attention_kernel == "math":
            return (f"attention: math kernel assumed ({why}, training.attention_backend={backend}): "
                    "fp32 heads x seq x seq probabilities saved per block")
        return (f"attention: a fused kernel assumed ({why}, training.attention_backend={backend}): "
                "no seq x seq term")

    def peft_note(self) -> str | None:
        """Under peft.method, what trains and what the analytic estimate's activations are, in one line."""
        adaptation = self.layout.adaptation
        if adaptation is None:
            return None
        return (f"{adaptation.method}: rank {adaptation.rank} adapters on {', '.join(adaptation.targets)} of every "
                "block train, the base is frozen (no gradients or optimizer states; autograd keeps what the "
                "adapters need of its activations: memory/closed_form/block/adapter_activations.py)")

    def fp8_note(self) -> str | None:
        """Under fp8-mixed, how its float8 casts are priced (perf/fp8_casts.py), in one line; else None.
        Eager, the compute is compared with bf16-mixed's on the same layout."""
        d, t = self.layout, self.perf.time
        if d.precision != "fp8-mixed":
            return None

        def ms(seconds: float) -> str:
            return f"{seconds * 1e3:,.1f} ms"

        casts = f"{ms(t['fp8_cast_s'])} of the step's compute"
        if d.compile:
            return (f"fp8-mixed under training.compile: torchao's casts to fp8 assumed fused (one read for the "
                    f"amax, one read and an fp8 write per cast): {casts}")
        cfg = self.cfg
        bf16 = compute_time_s(cfg.model, dataclasses.replace(d, precision="bf16-mixed"), cfg.training, cfg.hardware)
        slower = (f"; predicted slower than bf16-mixed here (compute {ms(t['compute_s'])} against {ms(bf16)})"
                  if t["compute_s"] > bf16 else "")
        return (f"fp8-mixed without training.compile: torchao's casts run as separate kernels (amax, scale, clamp, "
                f"cast, layout copies) over device memory: {casts}{slower}; training.compile=true fuses them")

    @property
    def fits(self) -> bool:
        return self.device_memory == 0 or self.memory_bytes <= self.device_memory


def estimate(cfg: Config, layout: Layout | None = None, engine: Engine = TRAINFIT_ENGINE) -> Estimate:
    """The full analytic estimate of a validated config (see trainfit.configure.load_config) on
    `layout` (default: its own, on hardware.num_gpus ranks); `engine`: whose engine runs the step
    (perf/engines.py; trainfit's own unless another engine's runs are priced)."""
    layout = layout or build_layout(cfg)
    if engine.ddp_master_weights and layout.zero_stage == 0 and layout.offload == "none" \
            and layout.precision.endswith("-mixed"):
        layout = dataclasses.replace(layout, ddp_master_weights=True)
    if engine.zero1_grad_reduce == "all_reduce" and layout.data_parallel == "zero1" and layout.zero_stage == 1:
        layout = dataclasses.replace(layout, zero1_grad_all_reduce=True)
    memory = estimate_memory(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer, engine)
    return Estimate(cfg=cfg, layout=layout, memory=memory,
                    perf=estimate_perf(cfg.model, layout, cfg.training, cfg.hardware, Rates.of(cfg.hardware, engine)),
                    device_memory=device_spec(cfg.hardware).memory_bytes)


def with_traced_memory(est: Estimate, traced: Any) -> Estimate:
    """`est` with the traced step's breakdowns (traced.TracedEstimate), each keeping the
    analytic reserved margin's terms but those the trace found itself: tracing sees tensors, not the
    CUDA context or NCCL's buffers, so without them `fits` would promise memory the device does not
    have; the caching allocator's fragmentation it replays (memory/traced/caching_allocator.py)."""

    def margin(t: MemoryBreakdown, a: MemoryBreakdown) -> MemoryBreakdown:
        terms = {**a.margin_terms, **t.margin_terms} if a.margin_terms else {}
        return dataclasses.replace(t, reserved_margin=sum(terms.values()), margin_terms=terms)

    stages = [margin(t, a) for t, a in zip(traced.per_stage, est.memory.per_stage, strict=True)]
    return dataclasses.replace(est, memory=dataclasses.replace(traced, per_stage=stages))


def _stage_json(est: Estimate, stage: MemoryBreakdown, index: int) -> dict[str, Any]:
    return {"stage": index, **stage.as_dict(), "device_memory": est.device_memory,
            "fits": est.device_memory == 0 or est.total_bytes(stage) <= est.device_memory}


def as_json(est: Estimate) -> dict[str, Any]:
    m = est.cfg.model
    counts = param_counts(m)
    d = est.layout
    per_rank = _stage_json(est, est.worst, est.memory.worst_stage)
    per_rank["layout"] = {
        "num_gpus": d.world_size, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp, "pp": d.pp,
        "cp": d.cp, "ep": d.ep, "zero_stage": d.zero_stage, "pp_virtual_stages": d.pp_virtual_stages,
        "grad_accum_steps": d.grad_accum_steps,
    }
    return {
        "model": {"preset": m.preset, "family": m.family, "num_params": counts.total,
                  "num_active_params": counts.active, "num_layers": m.num_layers, "dim": m.dim,
                  "vocab_size": m.vocab_size},
        "per_rank": per_rank,
        "per_stage": [_stage_json(est, s, i) for i, s in enumerate(est.memory.per_stage)],
        "flops": dict(est.perf.flops),
        "time": dict(est.perf.time),
        "fits": est.fits,
        "attention_kernel": est.attention_kernel,
    }


# ---------------------------------------------------------------- advice


# (what to change, how to say it); tried one at a time on a copy of the config.
_REMEDIES: list[tuple[str, Any, str]] = [  # roughly cheapest in time first
    ("memory.activation_checkpointing", "selective", "selective activation checkpointing"),
    ("memory.chunked_loss", True, "a chunked loss (logits never whole)"),
    ("parallel.zero_stage", 1, "ZeRO-1 (shard master weights and optimizer states)"),
    ("parallel.zero_stage", 2, "ZeRO-2 (shard optimizer states and gradients)"),
    ("parallel.zero_stage", 3, "ZeRO-3 / FSDP (shard parameters too)"),
    ("memory.activation_checkpointing", "full", "full activation checkpointing"),
    ("memory.offload", "optimizer", "offloading optimizer states to the host"),
]


def _with(cfg: Config, key: str, value: Any) -> Config:
    changed = copy.deepcopy(cfg)
    section, name = key.split(".")
    setattr(getattr(changed, section), name, value)
    return changed


def _remedies(est: Estimate) -> list[tuple[int, str, Estimate]]:
    """(bytes saved, words, estimate after) of each single remedy that lowers the worst rank's
    total, in _REMEDIES order, judged against the same device memory as `est`."""
    total = est.total_bytes(est.worst)
    out = []
    for key, value, words in _REMEDIES:
        section, name = key.split(".")
        if getattr(getattr(est.cfg, section), name) == value:
            continue
        try:
            changed = _with(est.cfg, key, value)
            other = estimate(changed, build_layout(changed, est.layout.world_size))
        except ValueError:  # the change is not valid for this layout (e.g. ZeRO with one rank)
            continue
        other = dataclasses.replace(other, device_memory=est.device_memory)
        saved = total - other.total_bytes(other.worst)
        if saved > 0:
            out.append((saved, f"{words} ({key}={value!r})", other))
    return out


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def advice(est: Estimate, limit: int = 4) -> list[str]:
    """Concrete single changes that lower the worst rank's peak, biggest saving first."""
    worst = est.worst
    lines = [(saved, f"{words} would save ~{_size(saved)} -> {_size(other.total_bytes(other.worst))} per GPU, "
                     f"{'fits' if other.fits else 'still does not fit'}")
             for saved, words, other in _remedies(est)]
    lines.sort(key=lambda item: item[0], reverse=True)
    share = {name: value / worst.peak for name, value in worst.components().items()} if worst.peak else {}
    head = [f"{name} are {share[name]:.0%} of the peak" for name, _ in worst.largest(2) if share.get(name)]
    return ["; ".join(head)] + [text for _, text in lines[:limit]] if lines else ["; ".join(head)]


def fitting_changes(est: Estimate, *, trainable: bool = False) -> list[str]:
    """The single changes after which the run fits est.device_memory, cheapest in compute first
    (the order of _REMEDIES), each with its total per rank; `trainable`: only those `trainfit
    train` can run."""
    return [f"{words} -> {_size(other.total_bytes(other.worst))}" for _, words, other in _remedies(est)
            if other.fits and not (trainable and other.layout.untrainable_reason())]
