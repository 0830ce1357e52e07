"""What a rank holds of its micro-batches' saved activations (`held_activations`, step_peak.py's end of the
forward and every moment after it), and a floor under the rank's peak (`peak_floor`) that costs a fraction of
step_peak.rank_breakdown: the model states plus what the end of the model's forward holds of activations.

The planner asks the floor before a whole estimate (plan/search.py): most layouts it tries do not fit, and
the floor alone exceeds the device's memory for most of those. A floor, not an estimate: the end of the
forward is one of the moments rank_breakdown weighs, and its other components (compute copies, logits,
gradients, buffers) are sizes, never below 0; the reserved margin only adds. tests/unit/test_plan.py checks
it against the peak of every layout a search estimates. Torch-free."""

from __future__ import annotations

from typing import NamedTuple

from trainfit.memory.closed_form.pipeline_held import PipelineHeld
from trainfit.memory.closed_form.rank_layout import LayoutCommon, RankLayout, first_block_saving
from trainfit.memory.closed_form.run_shape import Run
from trainfit.memory.closed_form.stage_activations import pipeline_batch_bytes
from trainfit.memory.closed_form.zero_states import StageStates, stage_states


class HeldActivations(NamedTuple):
    """Activation bytes a rank holds of its micro-batches (step_peak.rank_breakdown's a_blocks, a_final and
    older_own)."""

    blocks: int
    """One micro-batch's saved activations over the rank's blocks, each of its own kind of layer (and what the
    blocks share of it: its positions)."""
    final: int
    """...and of its final norm and head (the last stage's rank)."""
    older: float
    """The other micro-batches in flight (and under a pipeline schedule the step's token ids, all of them)."""


def held_activations(run: Run, common: LayoutCommon, lay: RankLayout, st: StageStates) -> HeldActivations:
    """What rank_breakdown sums of the micro-batches in flight on a rank of `lay` (states `st`)."""
    mb = common.micro_batch
    blocks = int(common.per_kind(lay, lambda _, k: k.micro_batch.none, wrapped=False)
                 + common.per_kind(lay, lambda _, k: k.micro_batch.policy, wrapped=True)) \
        + (mb.positions if lay.blocks else 0)
    blocks -= first_block_saving(run, lay, st.prec.act)  # PEFT: nothing before the first block trains
    final = mb.final if lay.last else 0
    older = (lay.in_flight - 1) * blocks + (lay.head_in_flight - 1) * final  # other micro-batches in flight
    if run.layout.pp > 1:  # and the step's token ids, all of them, on every pipeline rank
        older += pipeline_batch_bytes(run.layout.grad_accum_steps * run.layout.micro_batch_size,
                                      run.training.seq_len, run.layout.cp)
    return HeldActivations(blocks, final, older)


def resident_states(st: StageStates) -> int:
    """The model states every moment of the step holds (rank_breakdown adds each moment's to them)."""
    return st.persistent + st.optimizer + st.compute_params


def peak_floor(run: Run, common: LayoutCommon, lay: RankLayout, pipe: PipelineHeld) -> int:
    """At most rank_breakdown's peak on a rank of `lay` whose pipeline schedule holds `pipe` (the module
    docstring): the resident states and the end of the forward's activations, added as it adds them."""
    st = stage_states(run, common, lay)
    held = held_activations(run, common, lay, st)
    return resident_states(st) + int(held.older + pipe.pending + held.blocks + held.final
                                     + common.micro_batch.forward_masks)
