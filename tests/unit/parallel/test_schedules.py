"""parallel/schedules.py: one table of the pipeline schedules, which the config, torch's classes, the
stage split and the layout's checks must all agree with."""

from __future__ import annotations

import typing

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from trainfit.config import ConfigError
from trainfit.config.schema import PipelineSchedule
from trainfit.configure import load_config
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.schedules import SCHEDULES, bubble_fraction, micro_batches_in_flight, refuses
from trainfit.parallel.stage_split import rank_stages


def test_the_table_names_every_schedule_the_config_takes() -> None:
    assert set(SCHEDULES) == set(typing.get_args(PipelineSchedule))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_schedule_is_the_torch_class_it_names(name: str) -> None:
    schedule = SCHEDULES[name]
    cls = getattr(torch_schedules, schedule.torch_class)
    assert issubclass(cls, torch_schedules.PipelineScheduleSingle) == schedule.single_stage
    assert schedule.weight_pass_at_peak <= schedule.split_backward  # a weight pass needs a split backward


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_stages_per_rank_and_their_placement_follow_the_table(name: str) -> None:
    schedule = SCHEDULES[name]
    v = schedule.stages_per_rank
    stages = [rank_stages(r, 4, v, name) for r in range(4)]
    assert sorted(s for rank in stages for s in rank) == list(range(4 * v))
    assert stages[0] == ((0, 7) if schedule.v_shape else tuple(range(0, 4 * v, 4)))
    def layout_of(virtual: int, zero: int) -> object:
        return build_layout(load_config(None, [
            "--model.preset=debug", "--model.num_layers=4", f"--parallel.pp_schedule={name}", "--parallel.pp=2",
            f"--parallel.zero_stage={zero}", "--training.global_batch_size=8", "--training.micro_batch_size=1",
            f"--parallel.pp_virtual_stages={virtual}"]), 2)

    zero = 3 if schedule.split_backward else 0
    assert layout_of(0, zero).pp_virtual_stages == v
    if schedule.fixed_stages:
        with pytest.raises(ConfigError, match="parallel.pp_virtual_stages"):
            layout_of(1 if v == 2 else 2, zero)


def test_what_a_schedule_refuses_and_keeps() -> None:
    assert refuses("1f1b", 4, 1, 3) is not None and refuses("1f1b", 4, 1, 4) is None
    assert "per stage" in refuses("dualpipev", 4, 2, 6) and refuses("dualpipev", 4, 2, 8) is None
    assert "whole rounds" in refuses("interleaved-1f1b", 4, 2, 9)
    assert micro_batches_in_flight(4, 1, 8, "1f1b", 0) == (4.0, 1)
    assert micro_batches_in_flight(4, 1, 8, "1f1b", 3) == (1.0, 1)
    assert micro_batches_in_flight(4, 1, 8, "gpipe", 2) == (8.0, 8)
    assert micro_batches_in_flight(1, 1, 8, "gpipe", 0) == (1.0, 1)  # no pipeline: one micro-batch at a time
    # interleaved 1F1B's first rank: Korthikanti's L (1 + (p - 1) / (p v)), in units of the rank's L / p blocks
    assert micro_batches_in_flight(4, 2, 8, "interleaved-1f1b", 0)[0] == pytest.approx(4 * (1 + 3 / 8))
    assert bubble_fraction("dualpipev", 4, 8, 2) == 0.0 and bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 8)
