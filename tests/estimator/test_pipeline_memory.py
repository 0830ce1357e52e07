"""The analytic estimator's pipeline terms (memory/closed_form/pipeline_held.py `PipelineHeld`), each checked against
the tensor torch.distributed.pipelining holds (stage.py, schedules.py, _backward.py of torch 2.13).
Every stage against measured steps: the pipeline rows of the accuracy grid
(tests/estimator/test_accuracy.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from accuracy_grid import LLAMA, _row, row_config
from torch.distributed.pipelining import schedules as torch_schedules

from _runs import run_config
from trainfit.memory.closed_form import SharedSizes
from trainfit.memory.closed_form.block.activation_terms import FP32
from trainfit.memory.closed_form.pipeline_held import PipelineHeld, pipeline_held
from trainfit.memory.closed_form.rank_layout import layout_common, rank_layout
from trainfit.memory.closed_form.run_shape import Run
from trainfit.parallel.resolve import build_layout

MB, T, D, V, F, M = 2, 256, 128, 512, 384, 4
"""accuracy_grid.LLAMA's shape, 2-sequence micro-batches, 4 of them per step."""
PP2 = ("--parallel.pp=2", "--model.num_layers=4", "--training.global_batch_size=8", "--training.micro_batch_size=2")


def _held(tmp: Path, stage: int, *extra: str) -> PipelineHeld:
    cfg = row_config(_row("t", 2, LLAMA, *PP2, *extra), tmp)
    layout = build_layout(cfg)
    run = Run(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer)
    common = layout_common(run, SharedSizes(cfg.model))
    place = layout.rank_placement(stage)
    lay = rank_layout(run, common, place)
    logits = common.prec.act.compute * V * common.tokens if lay.last else 0
    return pipeline_held(run, lay, place, common.micro_batch, 0, logits)


BOUNDARY = MB * T * D * FP32
"""One micro-batch of the fp32 residual stream at a stage boundary."""


def test_receive_slots_one_per_micro_batch(tmp_path: Path) -> None:
    """stage.py: `_setup_forward_recv_info` gives every non-first stage one input buffer per
    micro-batch, `_create_grad_recv_info` every non-last stage one output-gradient buffer."""
    assert _held(tmp_path, 0).slots == M * BOUNDARY  # stage 0: gradient slots only
    assert _held(tmp_path, 1).slots == M * BOUNDARY  # stage 1 (last): input slots only
    interleaved = ("--parallel.pp_schedule=interleaved-1f1b",)
    assert _held(tmp_path, 0, *interleaved).slots == 3 * M * BOUNDARY  # stages 0 and 2
    assert _held(tmp_path, 1, *interleaved).slots == 3 * M * BOUNDARY  # stages 1 and 3
    zbv = ("--parallel.pp_schedule=zbv-zero-bubble",)
    assert _held(tmp_path, 0, *zbv).slots == 2 * M * BOUNDARY  # stages 0 (first) and 3 (last)
    assert _held(tmp_path, 1, *zbv).slots == 4 * M * BOUNDARY  # stages 1 and 2, both directions


def test_held_outputs_and_sends(tmp_path: Path) -> None:
    """1F1B rank 0: its 2 in-flight outputs (fwd_cache) and the warm-up send Schedule1F1B's
    `send_work` keeps; the last stage sends nothing forward, and keeps its last backward's input
    gradient (Schedule1F1B's `bwd_sends`). Looped BFS (a runtime schedule, its sends waited only
    at the step's end) at its peak, the end of its forwards: all 2 x 4 outputs."""
    assert _held(tmp_path, 0).sent == 3 * BOUNDARY
    assert _held(tmp_path, 1).sent == BOUNDARY
    assert _held(tmp_path, 0, "--parallel.pp_schedule=looped-bfs").sent == 2 * M * BOUNDARY
    assert _held(tmp_path, 1, "--parallel.pp_schedule=looped-bfs").sent == M * BOUNDARY  # stage 3 sends no output


def test_last_stage_logits(tmp_path: Path) -> None:
    """The last stage keeps each micro-batch's logits in fwd_cache (fp32 here: [mb, T, V] x 4)."""
    assert _held(tmp_path, 1).logits == MB * T * V * FP32
    assert _held(tmp_path, 0).logits == 0


def test_weight_pass_pending(tmp_path: Path) -> None:
    """ZB-V rank 0 at its peak: one chunk of stage 3 (the last) awaits its weight pass, keeping the
    gradient of every weight-using node's output (_backward.py stage_backward_input's pre-hooks):
    per token and block the norms' outputs and residual sums (4 D) and wq wk wv (D + 2 x 64), w1
    w3 (2 F); the head's final norm (D) and logits (V)."""
    kv = 64
    per_block = MB * T * FP32 * (4 * D + D + 2 * kv + 2 * F)
    head = MB * T * FP32 * (D + V)
    assert _held(tmp_path, 0, "--parallel.pp_schedule=zbv-zero-bubble").pending == per_block + head
    assert _held(tmp_path, 0).pending == 0


def _torch_order(name: str, p: int, m: int) -> dict[int, list]:
    """torch's own action order per rank (its schedule class on stand-in stages, no process group)."""
    cls = {"interleaved-zero-bubble": torch_schedules.ScheduleInterleavedZeroBubble,
           "zbv-zero-bubble": torch_schedules.ScheduleZBVZeroBubble,
           "dualpipev": torch_schedules.ScheduleDualPipeV}[name]
    ids = [0, 2 * p - 1] if name != "interleaved-zero-bubble" else [0, p]
    stages = [SimpleNamespace(stage_index=s, num_stages=2 * p, group_size=p, group_rank=0, is_first=s == 0,
                              is_last=s == 2 * p - 1, submod=None, has_backward=True, stage_index_to_group_rank={},
                              dw_builder=None) for s in ids]
    return cls(stages, n_microbatches=m, loss_fn=lambda a, b: a).pipeline_order


@pytest.mark.parametrize("name", ["interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_in_flight_from_torch_orders(name: str, p: int, m: int) -> None:
    """The chunks alive (forward done, weight pass not) at each rank's worst moment of torch's
    order, and those awaiting their weight pass then, are what `_in_flight` and `_pipeline_held`
    count."""
    cfg = run_config(Path("/nonexistent"), "--model.preset=debug", f"--model.num_layers={2 * p}",
                     f"--parallel.pp={p}", f"--parallel.pp_schedule={name}", f"--hardware.num_gpus={p}",
                     "--training.micro_batch_size=1", f"--training.global_batch_size={m}")
    layout = build_layout(cfg)
    run = Run(cfg.model, layout, cfg.training, cfg.hardware, cfg.optimizer)
    for rank, actions in _torch_order(name, p, m).items():
        alive, pending, worst = set(), set(), (0, 0)
        for action in actions:
            for a in (action.sub_actions or [action]) if action is not None else []:
                key, kind = (a.stage_index, a.microbatch_index), a.computation_type.value
                if kind == "F":
                    alive.add(key)
                elif kind in ("B", "W"):
                    alive.discard(key)
                    pending.discard(key)
                elif kind == "I":
                    pending.add(key)
                worst = max(worst, (len(alive), len(pending)))
        in_flight, _ = run.layout.micro_batches_in_flight(rank)
        assert worst[0] == in_flight * 2, (rank, worst)
        expected_pending = {"interleaved-zero-bubble": rank + 1, "zbv-zero-bubble": 1, "dualpipev": 0}[name]
        assert worst[1] == expected_pending, (rank, worst)
