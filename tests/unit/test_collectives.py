"""parallel/collectives.py declares a collective for every parallelism a Layout can have, and none
over a group of one rank."""

from __future__ import annotations

import itertools

import pytest

from trainfit.config import ConfigError
from trainfit.configure import load_config
from trainfit.parallel.collectives import SHARD, TENSORS, collective_calls, group_size
from trainfit.parallel.layout import AXES
from trainfit.parallel.resolve import build_layout
from trainfit.perf.comms import step_collectives

DEGREES = [  # (dp_replicate, tp, cp, ep, pp, sequence_parallel) on 8 ranks
    (1, 1, 1, 1, 1, False), (2, 1, 1, 1, 1, False), (1, 2, 1, 1, 1, False), (1, 2, 1, 1, 1, True),
    (1, 1, 2, 1, 1, False), (2, 1, 2, 1, 1, False), (1, 1, 1, 2, 1, False), (1, 1, 1, 4, 1, False),
    (1, 1, 1, 1, 2, False), (1, 2, 2, 1, 2, True), (2, 2, 1, 2, 1, True), (1, 1, 2, 2, 1, False),
    (1, 1, 8, 1, 1, False), (1, 8, 1, 1, 1, True),
]


def _layouts():
    for preset, stage, (rep, tp, cp, ep, pp, sp) in itertools.product(("debug", "debug-moe"), range(4), DEGREES):
        args = [f"--model.preset={preset}", "--hardware.num_gpus=8", f"--parallel.zero_stage={stage}",
                f"--parallel.dp_replicate={rep}", f"--parallel.tp={tp}", f"--parallel.cp={cp}",
                f"--parallel.ep={ep}", f"--parallel.pp={pp}", f"--parallel.sequence_parallel={str(sp).lower()}",
                "--training.seq_len=64", "--training.micro_batch_size=1"]
        try:
            cfg = load_config(None, args)
            yield pytest.param(cfg.model, build_layout(cfg), id="-".join(a.split(".")[-1] for a in args[:9]))
        except ConfigError:
            continue


@pytest.mark.parametrize(("model", "layout"), list(_layouts()))
def test_every_communicating_axis_has_a_declared_collective_and_no_group_is_one_rank(model, layout) -> None:
    calls = collective_calls(model, layout)
    assert all(group_size(layout, c.axes) > 1 and c.count > 0 and c.tensor in TENSORS for c in calls)
    used = {axis for c in calls if c.timed for axis in c.axes if group_size(layout, (axis,)) > 1}
    sizes = {**layout.axis_sizes(), "ep": layout.ep, "edp": layout.dp_shard * layout.cp // layout.ep}
    # Every mesh axis of more than one rank communicates; edp only where FSDP shards routed experts on it.
    expected = {axis for axis, size in sizes.items() if size > 1 and axis not in ("ep", "edp")}
    expected |= {"ep"} if layout.ep > 1 else set()
    expected |= {"edp"} if layout.ep > 1 and layout.zero_stage >= 2 and sizes["edp"] > 1 else set()
    assert used == expected
    techniques = {c.technique for c in calls if c.timed}
    assert ("tp" in techniques) == (layout.tp > 1) and ("pp" in techniques) == (layout.pp > 1)
    assert ("cp" in techniques) == (layout.cp > 1) and ("ep" in techniques) == (layout.ep > 1)
    data_parallel = {"ddp", "zero1", "fsdp"} & techniques
    assert data_parallel == (set() if layout.dp * layout.cp == 1 else
                             {("ddp", "zero1", "fsdp", "fsdp")[layout.zero_stage]})


def test_a_dense_block_under_sequence_parallelism_reduce_scatters_wo_and_w2_forward() -> None:
    cfg = load_config(None, ["--model.preset=debug", "--hardware.num_gpus=2", "--parallel.tp=2",
                             "--parallel.sequence_parallel=true", "--training.seq_len=64"])
    calls = collective_calls(cfg.model, build_layout(cfg))
    forward = {(c.kind, c.site) for c in calls if c.technique == "tp" and c.phase == "forward"}
    assert {("reduce_scatter", "attention.wo output"), ("reduce_scatter", "feed_forward.w2 output"),
            ("all_gather", "attention input"), ("all_gather", "feed_forward input")} <= forward


def test_the_trainers_all_reduces_are_declared_untimed_and_left_out_of_the_time_model() -> None:
    """train/step.py's logged loss over the world, clipping's gradient norm over the shard ranks, tp
    and pp (data_parallel.clip_grad_norm_): one number each, which perf/comms.py does not time."""
    cfg = load_config(None, ["--model.preset=debug", "--hardware.num_gpus=8", "--parallel.tp=2", "--parallel.pp=2",
                             "--parallel.zero_stage=3", "--training.seq_len=64"])
    layout = build_layout(cfg)
    untimed = [c for c in collective_calls(cfg.model, layout) if not c.timed]
    assert {(c.tensor, c.axes) for c in untimed} == {("loss", AXES), ("grad_norm", SHARD), ("grad_norm", ("tp",)),
                                                     ("grad_norm", ("pp",))}
    assert all(c.technique == "train" and c.kind == "all_reduce" and c.phase == "step" for c in untimed)
    assert not [c for c in step_collectives(cfg.model, layout, cfg.training) if c.phase == "step"]  # FSDP has none
