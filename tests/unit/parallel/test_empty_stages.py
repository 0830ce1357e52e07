"""A pipeline stage without blocks between the ends (nanotron's split leaves such stages): what torch's
pipelining and the step read of it, without a process group. Trained with parity on gloo ranks:
tests/distributed/test_pp_empty_stages.py."""

from __future__ import annotations

import torch
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input

from trainfit.configure import load_config
from trainfit.models import build_model, materialize
from trainfit.parallel.data_parallel import state_dicts
from trainfit.parallel.pipeline import StageParts, split_stages
from trainfit.parallel.resolve import build_layout
from trainfit.train.optim import build_optimizer


def _parameterless_parts() -> tuple[StageParts, int]:
    """Pipeline rank 1 of the debug model split 1,0,1 over pp3, materialized on the CPU, and the model's dim."""
    cfg = load_config(None, ["--model.preset=debug", "--training.seq_len=32", "--hardware.num_gpus=3",
                             "--parallel.pp=3", "--parallel.pp_layers_per_stage=1,0,1",
                             "--training.global_batch_size=3", "--training.micro_batch_size=1"])
    parts = StageParts(split_stages(build_model(cfg.model), build_layout(cfg), 1))
    return materialize(parts, "cpu"), cfg.model.dim


def test_a_stage_without_blocks_passes_its_input_on() -> None:
    """Its output is a new tensor on the input's storage (no copy), not a view (the zero-bubble input pass
    detaches outputs in place), and torch's full and input-only backwards give the input its gradient."""
    parts, dim = _parameterless_parts()
    (stage,) = parts.stages
    hidden = torch.randn(1, 32, dim, requires_grad=True)  # torch's receive buffer: a leaf
    grad = torch.randn(1, 32, dim)
    output = stage(hidden)
    assert output is not hidden and not output._is_view() and output.data_ptr() == hidden.data_ptr()
    assert torch.equal(output, hidden)
    (passed,) = stage_backward((output,), (grad,), [hidden])
    assert torch.equal(passed, grad)
    (passed,), _ = stage_backward_input([stage(hidden)], [grad], [hidden], iter(()))
    assert torch.equal(passed, grad)


def test_a_rank_without_parameters_steps_and_saves_nothing() -> None:
    """Its optimizer has one empty group (it steps, and keeps the learning-rate schedule's groups), and its
    checkpoint state is empty, where DCP's get_state_dict would refuse the empty model."""
    parts, _ = _parameterless_parts()
    assert next(parts.parameters(), None) is None
    cfg = load_config(None, [])
    optimizer = build_optimizer(parts, cfg.optimizer, cfg.training, "cpu")
    assert [group["params"] for group in optimizer.param_groups] == [[]]
    optimizer.step()
    assert state_dicts(parts, optimizer) == ({}, {})
