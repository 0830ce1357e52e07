"""What a pipeline schedule holds on one rank beyond its micro-batches' activations in flight (those are
parallel/schedules.py's): what torch.distributed.pipelining keeps (`PipelineHeld`: receive slots, sent tensors,
the zero-bubble weight pass's pending gradients, the last stage's logits). tests/estimator/test_pipeline_memory.py
walks torch's own orders against it. Another engine's buffers (perf/engines.Engine.pipeline_buffers):
Megatron-Core's, allocated per op. Torch-free."""

from __future__ import annotations

from typing import NamedTuple

from trainfit.memory.closed_form.micro_batch import MicroBatch
from trainfit.memory.closed_form.rank_layout import RankLayout
from trainfit.memory.closed_form.run_shape import Run
from trainfit.parallel.schedules import SCHEDULES
from trainfit.parallel.stage_split import RankPlacement


class PipelineHeld(NamedTuple):
    """What torch.distributed.pipelining holds on one pipeline rank beyond its micro-batches' saved
    activations (bytes; all 0 without pp)."""

    slots: int = 0
    """Receive slots, all step long and across steps (buffers): stage.py's
    `_setup_forward_recv_info` allocates, for every non-first stage, one input buffer per
    micro-batch (`_make_tensor_from_meta`, m of them), and `_create_grad_recv_info` (through
    `_setup_backward_recv_info(num_microbatches)`) one output-gradient buffer per micro-batch for
    every non-last stage. Between two stages of one rank (the V schedules) `set_local_fwd_input` /
    `set_local_bwd_input` replace them with the neighbour's output / input gradient: m each still."""
    sent: int = 0
    """Stage outputs and input gradients at the peak that no slot holds (buffers): the outputs of
    the in-flight micro-batches (`fwd_cache`, until their backward); Schedule1F1B's `send_work`,
    which keeps its next-to-last warm-up forward's send (and so that output) until the cooldown;
    Schedule1F1B's last input gradient sent (its `bwd_sends` ops list); the runtime schedules'
    sent tensors (every schedule but torch's PipelineScheduleSingle ones: torch runs them through
    _PipelineScheduleRuntime._step_microbatches, which keeps every SEND_F / SEND_B Work in one
    `send_ops` list until the step ends), at the end of the
    activation plateau: every forward sent, and the input gradients of the backwards done. The
    zero-bubble input pass also stores each input gradient in the input's `.grad`
    (stage_backward_input) until the next step's clear_runtime_states: the same tensor it sends."""
    pending: int = 0
    """Zero-bubble: the gradients the input pass keeps for the weight pass
    (stage_activations.weight_pass_pending_terms), and on the last stage the head's saved activations,
    of the micro-batches awaiting their weight pass at the peak (activations)."""
    logits: int = 0
    """The last stage's output, the logits ([mb, T, V] in the compute dtype), of one micro-batch:
    the stage keeps it in `fwd_cache` from its forward, and backward_one_chunk in a local through
    its backward (logits; counted for every micro-batch in flight)."""


def pipeline_held(run: Run, lay: RankLayout, place: RankPlacement, mb: MicroBatch, head_saved: int, logits: int
                   ) -> PipelineHeld:
    layout = run.layout
    if layout.pp == 1:
        return PipelineHeld()
    p, v, m, n, schedule = layout.pp, layout.pp_virtual_stages, layout.num_microbatches, layout.num_stages, \
        layout.pp_schedule
    stage, boundary, cross_next, cross_prev = place.rank, mb.boundary, place.sends_next, place.sends_prev
    slots = m * boundary * place.boundaries
    # Chunks (one micro-batch through one local stage) awaiting their weight pass at the peak, in
    # torch's orders: interleaved zero-bubble rank i, i + 1; ZB-V, 1; they are the rank's later
    # stage's (its backward runs first).
    pending_chunks = 0
    if SCHEDULES[schedule].weight_pass_at_peak:
        pending_chunks = min(m, stage + 1 if schedule == "interleaved-zero-bubble" else 1)
    if not SCHEDULES[schedule].single_stage:  # torch's runtime schedules
        # At the end of the plateau every forward is done, and every backward (input pass) but
        # those of the chunks still alive.
        chunks_alive = lay.in_flight * v
        backwards_done = max(0.0, m * v - chunks_alive + pending_chunks)
        sent = (m * cross_next + backwards_done * cross_prev / v) * boundary
    else:
        sent = lay.in_flight * cross_next * boundary
        if schedule == "1f1b" and cross_next and min(m, p - stage) >= 2:
            sent += boundary
        if schedule == "1f1b" and m > 1:
            # Schedule1F1B's `bwd_sends` (the P2P ops of the last backward's send) keeps that input
            # gradient until the next backward replaces it.
            sent += cross_prev * boundary
    pending = 0
    if pending_chunks:
        later = place.stages[-1]
        blocks = layout.pp_layers[later]
        per_chunk = blocks * mb.weight_pending if later > 0 else 0
        if later == n - 1:
            per_chunk += mb.head_weight_pending + head_saved
        pending = pending_chunks * per_chunk
    if run.engine.pipeline_buffers == "per_op":
        slots, sent = 0, _per_op_in_transit(place, boundary)
    return PipelineHeld(int(slots), int(sent), int(pending), logits if lay.last else 0)


def _per_op_in_transit(place: RankPlacement, boundary: int) -> int:
    """Megatron-Core's p2p (perf/engines.Engine.pipeline_buffers "per_op"): no slots, no kept outputs. At the
    backward's peak a rank that receives output gradients holds the one its backward consumes, and a rank
    that sends input gradients holds the one it sends and (1F1B's steady state pairs them) the next
    micro-batch's input arriving: one tensor per direction in transit, whatever the number of local stages
    (the schedule moves one per direction at a time)."""
    return boundary * (min(1, place.sends_next) + 2 * min(1, place.sends_prev))
