"""The fewest changes that make a config fit (`trainfit estimate` on one that does not). Torch-free.

From the planner's option lists (plan/search.Space, nothing fixed but the model, the hardware, the
batch and the precision): every single change of one choice (tensor, context or pipeline degree,
HSDP replicas, ZeRO stage, expert degree, micro-batch, checkpointing, offload, chunked loss) is
judged as `trainfit estimate` judges a config, then every pair of changes to two choices. Those
that fit and train are listed by how many choices they change, then by tokens/s, a pair only when
it is faster than every single change that fits. When none fits, the planner's fastest layouts
(plan/search.search), each with the choices it changes.

Every fix keeps the global batch: training.global_batch_size, or when it is 0 the batch `trainfit
train` derives from the config as given (micro_batch_size x its data-parallel ranks,
plan/space.with_global_batch), written into each fix's config: a fix that changes the micro-batch
or a degree accumulates gradients instead of changing the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainfit.config import Config, ConfigError
from trainfit.hardware import device_spec
from trainfit.memory.analytic import estimate_memory
from trainfit.parallel.resolve import build_layout
from trainfit.perf.timing import estimate_perf
from trainfit.plan.search import Candidate, search
from trainfit.plan.space import Space, replace_sections, settings_of, with_global_batch

Change = tuple[str, dict[str, dict[str, Any]]]
"""(words, {section: {field: value}}): one choice changed."""


@dataclass(frozen=True)
class Fix:
    changes: tuple[str, ...]
    """Each changed choice in words ("parallel.zero_stage=3")."""
    candidate: Candidate


def _changes(cfg: Config, space: Space) -> Iterator[Change]:
    """Every single change of one choice away from cfg's, from the planner's options."""
    p, mem = cfg.parallel, cfg.memory

    def layout(**values: Any) -> dict[str, dict[str, Any]]:  # a degree changed: the data-parallel split follows
        return {"parallel": {"dp_shard": -1, **values}}

    for tp in space.tp:
        if tp != p.tp:
            yield f"parallel.tp={tp}" + (" (sequence parallel)" if tp > 1 else ""), \
                layout(tp=tp, sequence_parallel=tp > 1)
    for name, options in (("cp", space.cp), ("pp", space.pp), ("ep", space.ep)):
        for value in options:
            if value != getattr(p, name):
                yield f"parallel.{name}={value}", layout(**{name: value})
    for zero in space.zero:
        if zero != p.zero_stage:
            yield f"parallel.zero_stage={zero}", {"parallel": {"zero_stage": zero}}
    dp = cfg.hardware.num_gpus // (p.tp * p.cp * p.pp)
    for replicate in space.dp_replicates(dp, p.cp * p.tp):
        if replicate != p.dp_replicate:
            yield f"parallel.dp_replicate={replicate}", layout(dp_replicate=replicate)
    for micro in space.micro_batches(dp):
        if micro != cfg.training.micro_batch_size:
            yield f"training.micro_batch_size={micro}", {"training": {"micro_batch_size": micro}}
    for policy, every in space.ac:
        if (policy, every) != (mem.activation_checkpointing, mem.ac_every_n_layers):
            words = f"memory.activation_checkpointing={policy}" + (f" every {every}" if every > 1 else "")
            yield words, {"memory": {"activation_checkpointing": policy, "ac_every_n_layers": every}}
    for offload in space.offload:
        if offload != mem.offload:
            yield f"memory.offload={offload}", {"memory": {"offload": offload}}
    if not mem.chunked_loss:
        yield "memory.chunked_loss=true", {"memory": {"chunked_loss": True}}


def _merge(changes: tuple[Change, ...]) -> dict[str, dict[str, Any]] | None:
    """The changes' fields together, or None when two of them set the same field."""
    merged: dict[str, dict[str, Any]] = {}
    for _, sections in changes:
        for section, values in sections.items():
            target = merged.setdefault(section, {})
            if set(target) & set(values) - {"dp_shard"}:
                return None
            target.update(values)
    return merged


def _judge(cfg: Config, changes: tuple[Change, ...], device_memory: int) -> Fix | None:
    merged = _merge(changes)
    if merged is None:
        return None
    changed = replace_sections(cfg, **merged)
    try:
        layout = build_layout(changed)
    except ConfigError:
        return None
    if layout.untrainable_reason() is not None:
        return None
    memory = estimate_memory(changed.model, layout, changed.training, changed.hardware, changed.optimizer)
    if any(s.peak + s.reserved_margin > device_memory for s in memory.per_stage):
        return None
    perf = estimate_perf(changed.model, layout, changed.training, changed.hardware)
    return Fix(tuple(words for words, _ in changes), Candidate(changed, layout, memory, perf, device_memory))


def fewest_changes(cfg: Config, limit: int = 5) -> list[Fix]:
    """Up to `limit` ways to make cfg fit its device, fewest changed choices first, then fastest,
    each keeping cfg's global batch (derived when 0: see the module docstring)."""
    device_memory = device_spec(cfg.hardware).memory_bytes
    if not device_memory:
        return []
    cfg, _ = with_global_batch(cfg)
    space = Space.of(cfg, frozenset(), (cfg.precision.mode,))
    singles = list(_changes(cfg, space))
    found: list[Fix] = []
    for count in (1, 2):
        fixes = sorted((fix for combo in itertools.combinations(singles, count)
                        if (fix := _judge(cfg, combo, device_memory)) is not None),
                       key=lambda f: -f.candidate.tokens_per_second)
        # a change more is worth listing only where it is faster than every fix with fewer
        fastest = max((f.candidate.tokens_per_second for f in found), default=0.0)
        found += [f for f in fixes if f.candidate.tokens_per_second > fastest]
    if found:
        return found[:limit]
    # More than two changes: the planner's fastest layouts, each with what it changes.
    kept = frozenset({"model.preset", "training.global_batch_size", "training.seq_len", "precision.mode"})
    mine = settings_of(cfg)
    return [Fix(tuple(f"{key}={value}" for key, value in c.settings().items() if mine[key] != value), c)
            for c in search(cfg, kept, top=limit).candidates]


METHODS = (("lora", {"peft": {"method": "lora", "targets": ("all-linear",)}}),
           ("qlora", {"peft": {"method": "qlora", "targets": ("all-linear",)}}))
"""Changes of method `method_changes` tries on a full fine-tune: LoRA on every linear, and the same on
an NF4 base (QLoRA)."""


def method_changes(cfg: Config) -> list[Fix]:
    """For a full fine-tune that does not fit: each change of method (peft.*) that fits, alone or with
    the one fewest_changes option that makes it fit fastest. Apart from fewest_changes, since it
    trains something else (adapters on a frozen base, not every weight)."""
    device_memory = device_spec(cfg.hardware).memory_bytes
    if not device_memory or cfg.peft.method != "none":
        return []
    cfg, _ = with_global_batch(cfg)
    space = Space.of(cfg, frozenset(), (cfg.precision.mode,))
    singles = list(_changes(cfg, space))
    found = []
    for name, fields in METHODS:
        base = "an NF4 base" if name == "qlora" else "a frozen base"
        method = (f"peft.method={name} peft.targets=all-linear (a change of method: adapters on {base})",
                  fields)
        alone = _judge(cfg, (method,), device_memory)
        if alone is not None:
            found.append(alone)
            continue
        paired = [fix for single in singles if (fix := _judge(cfg, (method, single), device_memory)) is not None]
        if paired:
            found.append(max(paired, key=lambda f: f.candidate.tokens_per_second))
    return found
