"""`trainfit plan` never lists what `trainfit train` refuses: every layout the planner keeps, for every
model preset, optimizer and world size of 1 to 8 GPUs, passes Layout.untrainable_reason (the one
place that says no) and is what `train` builds from the written config; and a sample of them runs
the trainer's own step, its optimizer included, on a fake world of the layout's size."""

from __future__ import annotations

import itertools
import typing
import warnings

import pytest

from trainfit.config import Config
from trainfit.config.schema import OptimizerName
from trainfit.configure import load_config
from trainfit.models.presets import PRESETS
from trainfit.parallel.layout import Layout
from trainfit.parallel.resolve import build_layout
from trainfit.plan.search import Plan, search
from trainfit.traced import trace_step

OPTIMIZERS: tuple[str, ...] = typing.get_args(OptimizerName)
WORLDS = (1, 2, 4, 8)


def plan_of(preset: str, world: int, optimizer: str, *, exhaustive: bool = False) -> Plan:
    """The plan of `preset` on `world` H100s for a global batch of 8 sequences of up to 2,048 tokens
    (two context-parallel ranks fit where the preset's context allows)."""
    seq_len = min(2048, PRESETS[preset]["max_seq_len"])
    args = [f"--model.preset={preset}", "--hardware.gpu=H100-SXM-80GB", f"--hardware.num_gpus={world}",
            f"--training.seq_len={seq_len}", "--training.global_batch_size=8", f"--optimizer.name={optimizer}"]
    cfg = load_config(None, args)
    return search(cfg, frozenset(a[2:].split("=")[0] for a in args), top=1, exhaustive=exhaustive)


def whole_parameters(layout: Layout) -> bool:
    """Adafactor's parameters stay whole: no ZeRO-1 row shards, no FSDP2 or tensor-parallel DTensors."""
    return layout.data_parallel in ("none", "ddp") and layout.tp == 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_the_planner_keeps_only_layouts_train_runs(preset: str) -> None:
    """Every setting the search estimated and found fitting (what the list is drawn from, whatever
    --top) trains, and its config gives `train` the same layout. The search lists one layout here,
    to stay quick: it estimates more on its way (the rules are checked on each of those)."""
    for world, optimizer in itertools.product(WORLDS, OPTIMIZERS):
        plan = plan_of(preset, world, optimizer)
        assert all(any(c is f for f in plan.fitting) for c in plan.candidates)
        for c in plan.fitting:
            assert c.layout.untrainable_reason() is None, (world, optimizer, c.settings())
            assert build_layout(c.cfg) == c.layout
            assert optimizer != "adafactor" or whole_parameters(c.layout), (world, c.settings())


def _sample(optimizer: str, size: int) -> list[tuple[Config, Layout]]:
    """`size` layouts of the debug presets' plans on 1-4 ranks (where every degree composes with
    the others already), each of another kind (how the model states are laid out, and which degrees
    are above 1), the most composed first."""
    kinds: dict[tuple[str, bool, bool, bool, bool, bool], tuple[Config, Layout]] = {}
    for preset, world in itertools.product(("debug-moe", "debug-gpt2", "debug"), (1, 2, 4)):
        for c in plan_of(preset, world, optimizer, exhaustive=True).fitting:
            L = c.layout
            if L.pp > 1 and preset == "debug-moe":
                continue  # the tracer cannot slice the pipeline's mesh axis under a MoE yet (trained, not traced)
            kind = (L.data_parallel, L.tp > 1, L.pp > 1, L.ep > 1, L.cp > 1, L.offload != "none")
            kinds.setdefault(kind, (c.cfg, L))
    ordered = sorted(kinds, key=lambda kind: (-sum(kind[1:]), kind))
    return [kinds[kind] for kind in ordered[:size]]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_sample_of_planned_layouts_steps_the_trainers_optimizer(optimizer: str) -> None:
    """The traced estimator runs the trainer's step as rank 0 of the layout's world (fake process
    group, fake tensors): parallelize, the trainer's optimizer built on the parallel parameters (or
    ZeRO-1's shards), its states created and one step taken. Adafactor's sample is one process, DDP
    and pipeline stages: where it has whole parameters."""
    sample = _sample(optimizer, 2)
    assert len(sample) == 2
    for cfg, layout in sample:
        assert optimizer != "adafactor" or whole_parameters(layout)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ineffective options and DTensor's CPU RNG notes
            traced = trace_step(cfg, layout)
        assert traced.worst.peak > 0
