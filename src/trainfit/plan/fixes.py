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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from trainfit.config import Config, ConfigError
from trainfit.hardware import device_spec
from trainfit.memory.closed_form import estimate_memory
from trainfit.parallel.resolve import build_layout
from trainfit.perf.timing import estimate_perf
from trainfit.plan.search import Candidate, search
from trainfit.plan.space import Space, replace_sections, settings_of, with_global_batch

Change = tuple[str, dict[str, dict[str, Any]]]
"""(words, {section: {field: value}}): one choice changed; the words are its overrides (`override`)."""
FOLLOWERS = {"parallel.dp_shard"}
"""Fields a change sets only so that the others can change (-1: derived again from the degrees)."""


@dataclass(frozen=True)
class Fix:
    changes: tuple[str, ...]
    """Each changed choice as the overrides a user types for it, space-separated, each written as
    `--section.field=value` takes it without its dashes ("parallel.tp=8 parallel.sequence_parallel=true")."""
    candidate: Candidate
    note: str = ""
    """What a change of method trains instead ("adapters on a frozen base")."""

    @property
    def overrides(self) -> list[str]:
        """Every override of every change, `--section.field=value`."""
        return [f"--{token}" for change in self.changes for token in change.split()]


def override(key: str, value: Any) -> str:
    """`section.field=value` as the command line takes it: booleans true/false, lists comma-separated."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, tuple | list):
        text = ",".join(map(str, value))
    else:
        text = str(value)
    return f"{key}={text}"


def _words(cfg: Config, fields: dict[str, dict[str, Any]]) -> str:
    """The overrides of the fields that change cfg (a follower only where it is not derived already)."""
    tokens = []
    for section, values in fields.items():
        for name, value in values.items():
            if getattr(getattr(cfg, section), name) != value:
                tokens.append(override(f"{section}.{name}", value))
    return " ".join(tokens)


def _changes(cfg: Config, space: Space) -> Iterator[Change]:
    """Every single change of one choice away from cfg's, from the planner's options."""
    p, mem = cfg.parallel, cfg.memory

    def layout(**values: Any) -> dict[str, dict[str, Any]]:  # a degree changed: the data-parallel split follows
        return {"parallel": {"dp_shard": -1, **values}}

    def change(fields: dict[str, dict[str, Any]]) -> Change:
        return _words(cfg, fields), fields

    for tp in space.tp:
        if tp != p.tp:
            yield change(layout(tp=tp, sequence_parallel=tp > 1))
    for name, options in (("cp", space.cp), ("pp", space.pp), ("ep", space.ep)):
        for value in options:
            if value != getattr(p, name):
                yield change(layout(**{name: value}))
    for zero in space.zero:
        if zero != p.zero_stage:
            yield change({"parallel": {"zero_stage": zero}})
    dp = cfg.hardware.num_gpus // (p.tp * p.cp * p.pp)
    for replicate in space.dp_replicates(dp, p.cp * p.tp):
        if replicate != p.dp_replicate:
            yield change(layout(dp_replicate=replicate))
    for micro in space.micro_batches(dp):
        if micro != cfg.training.micro_batch_size:
            yield change({"training": {"micro_batch_size": micro}})
    for policy, every in space.ac:
        if (policy, every) != (mem.activation_checkpointing, mem.ac_every_n_layers):
            yield change({"memory": {"activation_checkpointing": policy, "ac_every_n_layers": every}})
    for offload in space.offload:
        if offload != mem.offload:
            yield change({"memory": {"offload": offload}})
    if not mem.chunked_loss:
        yield change({"memory": {"chunked_loss": True}})


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


def _judge(cfg: Config, changes: tuple[Change, ...], device_memory: int, note: str = "") -> Fix | None:
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
    return Fix(tuple(words for words, _ in changes), Candidate(changed, layout, memory, perf, device_memory), note)


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
        return _distinct(found)[:limit]
    # More than two changes: the planner's fastest layouts, each with what it changes.
    kept = frozenset({"model.preset", "training.global_batch_size", "training.seq_len", "precision.mode"})
    mine = settings_of(cfg)
    return _distinct([Fix(tuple(override(key, value) for key, value in c.settings().items()
                                if mine[key] != value and not _derived(key, value, c)), c)
                      for c in search(cfg, kept, top=limit).candidates])


def _derived(key: str, value: Any, c: Candidate) -> bool:
    """A follower at the value it would be derived at (dp_shard = the ranks the other degrees leave)."""
    return key in FOLLOWERS and value == c.layout.dp_shard and c.cfg.parallel.dp_shard in (-1, value)


SAME_OFFLOAD = ("memory.offload=optimizer+params", "memory.offload=optimizer")
"""Under ZeRO-3 the two offloads are one mechanism: FSDP2 keeps the sharded parameters with the optimizer
states on the host either way, and ZeRO-3 frees the gathered ones after each block either way
(parallel/data_parallel.py)."""


def _distinct(fixes: list[Fix]) -> list[Fix]:
    """The fixes, each once: under ZeRO-3, offloading optimizer+params is offloading the optimizer."""
    seen, out = set(), []
    for fix in fixes:
        same = fix.candidate.layout.zero_stage == 3
        key = tuple(change.replace(*SAME_OFFLOAD) if same else change for change in fix.changes)
        if key not in seen:
            seen.add(key)
            out.append(fix)
    return out


METHODS = (("lora", {"peft": {"method": "lora", "targets": ("all-linear",)}}),
           ("qlora", {"peft": {"method": "qlora", "targets": ("all-linear",)}}))
"""Changes of method `method_changes` tries on a full fine-tune: LoRA on every linear, and the same on
an NF4 base (QLoRA)."""
KNOBS = frozenset({"memory.activation_checkpointing", "memory.chunked_loss", "precision.mode"})
"""What a change of method is searched with (the settings a fine-tune on a small device takes):
checkpointing, the chunked loss and the precision (bf16 weights, bf16-pure, on a GPU)."""


def _knob_changes(cfg: Config, space: Space) -> list[tuple[Change, ...]]:
    """Every setting of checkpointing x the chunked loss x precision, each as the changes from cfg's
    (the empty tuple: cfg's own)."""
    mem = cfg.memory

    def changes(*fields: dict[str, dict[str, Any]]) -> list[tuple[Change, ...]]:
        return [()] + [((_words(cfg, f), f),) for f in fields if _words(cfg, f)]

    checkpointing = changes(*({"memory": {"activation_checkpointing": policy, "ac_every_n_layers": every}}
                              for policy, every in space.ac))
    chunked = changes() if mem.chunked_loss else changes({"memory": {"chunked_loss": True}})
    precisions = changes({"precision": {"mode": "bf16-pure"}}) if cfg.hardware.gpu != "cpu" else changes()
    return [a + c + p for a in checkpointing for c in chunked for p in precisions]


def method_changes(cfg: Config, fixes: Sequence[Fix] = ()) -> list[Fix]:
    """For a full fine-tune that does not fit: each change of method (peft.*) that fits, at its fastest
    setting of checkpointing, the chunked loss and precision (KNOBS), with no other change or failing
    that with the one fewest_changes option that fits fastest; each only where it is faster than every
    one of `fixes` (the fewest changes that fit while training every weight). Apart from fewest_changes,
    since it trains something else (adapters on a frozen base, not every weight)."""
    device_memory = device_spec(cfg.hardware).memory_bytes
    if not device_memory or cfg.peft.method != "none":
        return []
    cfg, _ = with_global_batch(cfg)
    space = Space.of(cfg, frozenset(), (cfg.precision.mode,))
    layouts = [change for change in _changes(cfg, space) if not _sets(change, KNOBS)]
    knobs = _knob_changes(cfg, space)
    fastest_fix = max((f.candidate.tokens_per_second for f in fixes), default=0.0)
    found = []
    from trainfit.configure.validate import qlora_available

    for name, fields in METHODS:
        if name == "qlora" and not qlora_available():
            continue  # not offered where it cannot train (validation's named error: pip install torchao)
        note = f"adapters on {'an NF4 base' if name == 'qlora' else 'a frozen base'}"
        method = (_words(cfg, fields), fields)
        best: Fix | None = None
        for extra in ((), *((change,) for change in layouts)):
            for knob in knobs:
                fix = _judge(cfg, (method, *knob, *extra), device_memory, note)
                if fix is not None and (best is None or _faster(fix, best)):
                    best = fix
            if best is not None and not extra:
                break  # one more change only where none fits without
        if best is not None and best.candidate.tokens_per_second > fastest_fix:
            found.append(best)
    return found


def _sets(change: Change, keys: frozenset[str]) -> bool:
    """Whether a change sets one of `keys` ("section.field")."""
    return any(f"{section}.{name}" in keys for section, values in change[1].items() for name in values)


def _faster(fix: Fix, than: Fix) -> bool:
    """Faster, or as fast with fewer changes."""
    a, b = fix.candidate.tokens_per_second, than.candidate.tokens_per_second
    return a > b or a == b and len(fix.changes) < len(than.changes)
