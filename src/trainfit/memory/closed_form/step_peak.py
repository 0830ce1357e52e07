"""A rank's memory at the step's peak moment (`rank_breakdown`): its model states (memory/closed_form/zero_states.py)
plus what each moment of the step adds (the end of the forward, the loss, the backward of the stage's last and
first block and of the blocks between them where one can be larger, each of its own kind of layer: its MLP's,
its attention's, each branch's first linears'; the optimizer step): compute copies,
FSDP's gathered parameters and reduce buffers, gradients accumulated so far, the activations alive, fp8's
backward casts; the largest moment is the peak and each phase's largest is kept. The one place that decides
what coexists when. Torch-free."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import NamedTuple

from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.closed_form.block.activation_terms import Terms, scores_kept, ungated_mlp
from trainfit.memory.closed_form.block.activations import shared_experts_saved
from trainfit.memory.closed_form.block.adapter_activations import nf4_dequant_bytes
from trainfit.memory.closed_form.block.attention_activations import context_parallel_mask_bytes
from trainfit.memory.closed_form.block.moe_activations import RoutedMoment, routed_backward_moments
from trainfit.memory.closed_form.logits import LossBytes
from trainfit.memory.closed_form.micro_batch import MicroBatch
from trainfit.memory.closed_form.optimizer_memory import on_zero_shard
from trainfit.memory.closed_form.peak_floor import held_activations, resident_states
from trainfit.memory.closed_form.pipeline_held import PipelineHeld
from trainfit.memory.closed_form.rank_layout import LayoutCommon, RankLayout, first_block_casts_unsaved
from trainfit.memory.closed_form.run_shape import Run, rope_table_bytes
from trainfit.memory.closed_form.zero_states import StageStates, stage_states
from trainfit.memory.margin import reserved_margin_terms
from trainfit.models.architecture import describe
from trainfit.models.block_spec import block_linears
from trainfit.parallel.engine import DDP_GRADIENT_AS_BUCKET_VIEW, FSDP_PREFETCH_BLOCKS, FSDP_REDUCE_BYTES_MIXED
from trainfit.parallel.schedules import SCHEDULES
from trainfit.peft.spec import adapter_params, adapter_params_of, routed_adapter_params
from trainfit.perf.kernels import float8_gemms

FLOAT8_CAST_BYTES = 9
"""Bytes per element while torchao 0.18 casts a tensor to fp8, eager (float8_training_tensor.
_ToFloat8ConstrFunc, float8_utils.to_fp8_saturated): `tensor.to(float32) * scale` (fp32; the bf16
input's fp32 copy is freed once multiplied), then its clamp (fp32) while the product is still
referenced, then the fp8 bits of the clamp: 4 + 4 + 1. The amax's abs() (the input's dtype) is freed
before. The same for tensorwise and rowwise scales (one fp32 per tensor, or per row: negligible)."""


FLOAT8_CAST_BYTES_COMPILED = 1
"""The same cast inside a block compiled by training.compile: inductor fuses its pointwise chain
(upcast, scale, clamp, fp8 conversion) into one kernel after the amax's reduction, so only its fp8
output is allocated (perf/fp8_casts.py prices the same fusion's traffic)."""


def _float8_backward_bytes(k: int, n: int, tokens: int, casts_weight: bool, cast_bytes: int) -> int:
    """What one float8 Linear's backward allocates beyond its saved input and incoming gradient, at its
    largest moment (torchao 0.18, float8_linear.matmul_with_hp_or_float8_args.backward, whose locals
    live until it returns), for the rank's k -> n shard of it (perf/kernels.float8_gemms): the
    output gradient cast to fp8 for the input gradient (G8), the weight cast (unless FSDP2 gathered it
    in fp8), the input gradient (bf16), the output gradient cast again for the weight gradient, the
    input cast; each cast at `cast_bytes` per element while it runs (FLOAT8_CAST_BYTES eager,
    FLOAT8_CAST_BYTES_COMPILED compiled, where the kernels free what they no longer need: a bound).
    Moments: casting the weight, the second output-gradient cast, the input cast. The weight
    gradient's matmul comes after, with the casts' temporaries freed (bf16 weight gradient: <= what
    the input cast held)."""
    w = k * n if casts_weight else 0
    return max(tokens * n + cast_bytes * w,
               tokens * (n + 2 * k + cast_bytes * n) + w,
               tokens * (2 * n + 2 * k + cast_bytes * k) + w)


class BlockMoment(NamedTuple):
    """What one block adds at a moment of its backward, beyond the step's states (bytes)."""

    what: str
    """Which moment: "mlp", "attention", "fp8 casts", "wq", "w1", ... (in_backward says when each falls)."""
    grads: int
    buffers: int
    activations: int
    casts: int = 0
    """16-bit weight casts beyond the blocks' (negative: a routed expert's that autocast never made)."""


class Moment(NamedTuple):
    """One moment of the step: what is live then beyond the model states, by component (bytes). The
    largest is the peak."""

    phase: str
    """forward | backward | optimizer."""
    what: str
    """Which moment of the phase (the step's end of forward, the loss, a block's backward moment, ...)."""
    params: float
    """Compute copies of the parameters (gathered, kept, autocast's casts)."""
    activations: float
    logits: float
    grads: float
    buffers: float

    def total(self) -> float:
        return self.params + self.activations + self.logits + self.grads + self.buffers


class OutputGradient(NamedTuple):
    """Where the MLP's output matmul's weight gradient sits at the MLP's backward peak (bytes)."""

    grads: int = 0
    """In `.grad`."""
    buffers: int = 0
    """FSDP's unsharded copy, until the block's reduce-scatter."""
    in_flight: int = 0
    """Just made, an activation until its cast back or its bucket's hook takes it."""


class Earlier(NamedTuple):
    """What the gradients of earlier backwards (accumulation, or a pipeline's earlier micro-batches)
    make of one backward's moments (bytes)."""

    before: int
    """Gradients present before the backward's first: accumulated, or buckets from the step's start."""
    separate: float
    """DDP accumulating: bytes per parameter element of the unsynced `.grad` still beside its bucket."""
    staged: int
    """FSDP under a pipeline schedule, mixed precision: FSDP2's reduce-dtype accumulations (buffers)."""
    later_grads: int
    """Gradients present at the first block's backward: of the rank's other parameters."""
    first_comms: int
    """FSDP's gathered blocks and reduce staging at the first block's backward."""
    head_grad: int
    """The output projection's weight and input gradients in flight (0: no such moment)."""
    acc: bool
    """Some backwards ran before this one (accumulation, or a pipeline's earlier micro-batches)."""

    def pending(self, elements: int) -> int:
        return int(self.separate * elements)


class GradientHolding(NamedTuple):
    """How a rank holds the gradients its blocks make, alike for every kind of block."""

    autograd_bytes: float
    """Bytes per element of the gradients autograd makes (the module's parameters' dtype)."""
    per_param: float
    """Bytes per parameter element held in `.grad` until the step (0: none beyond the buckets)."""
    bucketed: bool
    """Gradients are buckets that exist from the step's start (DDP's gradient_as_bucket_view, ZeRO-1)."""
    tied_pending: int
    """A tied weight's gradient waiting in autograd's accumulation buffer for the embedding's share."""


class BlockSide(NamedTuple):
    """One kind of block on a rank, as the step's backward moments read it (bytes, elements where said)."""

    moments: Callable[[bool], list[BlockMoment]]
    """What the block adds at each moment of its backward: left by the policy (False) or checkpointed (True)."""
    saved: int
    """What it saves for backward, unwrapped (one micro-batch)."""
    kept: int
    """What it keeps, checkpointed."""
    cast: int
    """Autocast's casts of its linears."""
    copy: int
    """Its compute copy as FSDP gathers it (fp8 and NF4 weights in their own bytes)."""
    gather: int
    """ZeRO-3's gathered copy of it in its backward (copy; 0 where nothing is gathered per block)..."""
    prefetched: int
    """...and of that, what exists while the block after it runs (FSDP_PREFETCH_BLOCKS)."""
    grad_elements: int
    """Gradient elements it makes (PEFT: its adapters')."""
    params: int
    """Its parameters on the rank (elements)."""
    experts: int
    """Of those, routed-expert weights (elements)."""
    nf4_gathered: int
    """QLoRA: the compute copy's bytes that NF4 saves."""
    dequant: int
    """QLoRA: its largest NF4 weight dequantized beside a matmul."""


def _block_side(run: Run, common: LayoutCommon, lay: RankLayout, st: StageStates,
                holding: GradientHolding) -> BlockSide:
    """A block of the kind `run`, `common` and `lay` describe, on a rank whose stage states are `st`."""
    mb, prec, act, tp = common.micro_batch, st.prec, st.prec.act, run.layout.tp
    policy = run.layout.activation_checkpointing
    autograd_bytes, per_param, bucketed, tied_pending = holding

    def size(terms: Terms) -> int:
        return terms.bytes(st.tokens, st.seq, tp, run.layout.sequence_parallel)

    routing, transient, a_none, a_policy, rebuild = mb.routing, mb.transient, mb.none, mb.policy, mb.rebuild
    c = prec.compute
    cast_block = c * (lay.block_matmul - lay.block_float8 - lay.block_nf4) if act.autocast else 0
    # FSDP2 float8 all-gather: a block's float8 weights are gathered (and kept) in fp8, 1 byte each.
    # QLoRA: a block's NF4 weights are gathered (and kept) as NF4 (peft/nf4.py).
    nf4_gathered = lay.block_nf4 * c - lay.block_nf4_bytes
    fp8_gathered = (lay.block_float8 * (c - 1) if run.layout.fp8_gathers else 0) + nf4_gathered
    kept_unsharded = st.fsdp and (run.layout.zero_stage == 2 or run.layout.splits_backward)
    copy = c * lay.block - fp8_gathered
    # (PEFT: the block's gradients are its adapters')
    block_grads = lay.block if run.layout.adaptation is None else adapter_params(run.model, run.layout.adaptation,
                                                                                   run.layout.ep)

    # The MLP's output matmul (w2 / fc2) has its weight gradient by the MLP's backward peak: in
    # .grad after SwiGLU's w2 (under FSDP an unsharded gradient, until the block's reduce-scatter);
    # GELU's peak is inside fc2's backward, where under autocast the 16-bit weight gradient is not
    # yet cast and accumulated. Bucketed, the peak is w2's own backward: its weight gradient, just
    # made (an activation gradient until the bucket's hook takes it), beside its input's gradient.
    w2_in_flight = ungated_mlp(run.model) and act.autocast

    def output_gradient(elements: int, in_flight: bool = False) -> OutputGradient:
        if in_flight:
            return OutputGradient(in_flight=c * elements)
        if st.fsdp:
            return OutputGradient(buffers=c * elements)
        if bucketed:
            return OutputGradient(in_flight=int(autograd_bytes * elements))
        return OutputGradient(grads=int(elements * per_param))

    w2 = output_gradient(lay.mlp_out, w2_in_flight)
    # MoE: the shared experts' backward runs first (mlp_* of `transient`; their w2 for w2), then the
    # routed experts' (moe_activations.routed_backward_moments); the routed output is in the stream's
    # dtype, so no grad_cast then.
    routed_moments: list[RoutedMoment] = []
    shared_kept = shared_rebuilt = 0
    if routing is not None:
        m, adaptation, ep = run.model, run.layout.adaptation, run.layout.ep
        shared_w2 = m.num_shared_experts * m.expert_ffn_dim * m.dim
        expert_weight, shared_weights = common.counts.routed_experts // 3 // ep, None
        if adaptation is not None:  # PEFT: the weight gradients are the adapters' (frozen experts have none)
            shared_w2 = adapter_params_of(m, adaptation, ["shared_w2"])
            shared_weights = adapter_params_of(m, adaptation, ["shared_w1", "shared_w2", "shared_w3"])
            expert_weight = routed_adapter_params(m, adaptation, ep) // 3
        w2 = output_gradient(shared_w2)
        routed_moments = routed_backward_moments(
            m, act, transient, routing, size, expert_weight=expert_weight,
            grad_bytes=c if st.fsdp else autograd_bytes, num_local_experts=m.num_experts // ep,
            policy=policy, shared_weights=shared_weights)
        shared_kept, shared_rebuilt = (size(t) for t in shared_experts_saved(m, act, policy))

    def routed(done: int) -> tuple[int, int]:
        """(grads, buffers) of `done` gradient elements (FSDP: unsharded compute copies, buffers)."""
        return (0, c * done) if st.fsdp else (int(done * per_param), 0)

    # fp8-mixed: the largest float8 backward's own allocations (_float8_backward_bytes), at the start
    # of the block's backward (its saved activations all there): the MLP's output Linear (w2) or the
    # attention's (wo), the first of each branch to run backward. MoE: wo and the shared experts' w2.
    # Their incoming gradient is the branch's: with sequence parallelism the all-gathered one.
    float8 = {g.name: g for g in float8_gemms(run.model, run.layout)} if lay.block_float8 else {}
    cast_bytes = FLOAT8_CAST_BYTES_COMPILED if run.layout.compile else FLOAT8_CAST_BYTES
    fp8_backward = max((_float8_backward_bytes(float8[name].k, float8[name].n, st.tokens, not run.layout.fp8_gathers,
                                               cast_bytes) for name in ("w2", "wo", "shared_w2") if name in float8),
                       default=0)

    # The backward of each branch's first linears (backward_transients.FirstLinears): the attention's
    # wq, after every other weight gradient of the block is made (all but the attention norm's), and
    # the MLP's w1 (fc1), after the MLP's others; MoE: the attention's only (the experts' are in
    # routed_moments). fp8-mixed: also inside the linear's float8 backward, in its casts, before its
    # own weight gradient (its input gradient is among _float8_backward_bytes's allocations).
    linears = {w.name: w.local_params(tp, run.layout.ep) for w in block_linears(run.model)}
    linears_in = {w.name: w.in_features for w in block_linears(run.model)}
    attention_norm = describe(run.model).norm.params(run.model.dim)
    mlp_linears = () if routing is not None else ("w1", "w2", "w3") if "w3" in linears else ("w1", "w2")
    input_grad = c * run.model.dim * st.tokens  # the first linear's input gradient, in FirstLinears' *_new

    def made(done: int, own: int) -> tuple[int, int, int]:
        """(grads, buffers, activations) of `done` weight-gradient elements of the block, the last
        linear's (`own` of them) just made: under FSDP unsharded compute copies until the block's
        reduce-scatter (buffers); else `.grad` (bucketed: in the buckets from the step's start), the
        linear's own still in flight under autocast (16-bit, before its cast back) or bucketed (until
        its bucket's hook takes it)."""
        if st.fsdp:
            return 0, c * done, 0
        flight = c * own if act.autocast else int(autograd_bytes * own) if bucketed else 0
        return int((done - (own if act.autocast else 0)) * per_param), 0, flight

    def first_linear_moments(stream: int, kept: int | None = None) -> list[BlockMoment]:
        """The moments of FirstLinears beside the stream's gradient (`stream`), for a block that saved its
        tensors, or for a checkpointed one (`kept`: its kept tensors with the stream's gradient; at the
        MLP's first linears a bound, some are freed by then) that keeps its input and holds what its
        recompute rebuilt (buffers)."""
        wrapped = kept is not None
        at_wq = (mb.first_rebuilt, stream + mb.first_input) if wrapped else (0, stream + mb.first_kept)
        branches = [("wq", linears["wq"], lay.block - attention_norm, at_wq, mb.first_attention_new)]
        if mlp_linears:
            at_w1 = (max(0, rebuild - mb.first_mlp_freed), kept) if wrapped else \
                (0, stream + a_none - mb.first_mlp_freed)
            branches.append(("w1", linears["w1"], sum(linears[name] for name in mlp_linears), at_w1, mb.first_mlp_new))
        moments = []
        for name, own, done, (rebuilt, held), new in branches:
            grads, buffers, flight = made(done, own)
            moments.append(BlockMoment(name, grads, buffers + rebuilt, held + new + flight))
            if name in float8:
                grads, buffers, _ = made(done - own, 0)
                casts = _float8_backward_bytes(float8[name].k, float8[name].n, st.tokens, not run.layout.fp8_gathers,
                                               cast_bytes)
                moments.append(BlockMoment(f"{name} fp8 casts", grads, buffers + rebuilt,
                                           held + new - input_grad + casts))
        return moments

    # QLoRA: each NF4 linear's forward and input-gradient matmul dequantize its weight beside them
    dequant = nf4_dequant_bytes(run.model, run.layout.adaptation) if lay.blocks else 0

    def in_backward(wrapped: bool) -> list[BlockMoment]:
        """What a block adds at each moment of its backward.
        Unwrapped: its saved activations with the attention's or the MLP's gradients. Checkpointed:
        the recompute just done, or the MLP's gradients (by the attention's turn the MLP's recompute
        is freed). Either: or the backward of a branch's first linears (first_linear_moments). MoE: or
        a moment of the routed experts' backward."""
        # With sequence parallelism the branch's cast is all-gathered (branch_grad) and freed.
        stream, cast = mb.grad_stream + tied_pending, 0 if run.layout.sequence_parallel else mb.grad_cast
        incoming = mb.branch_grad if run.layout.sequence_parallel else cast  # a branch's output gradient
        # The math attention kernel's backward, or the eager soft-capped one's (S²-sized gradients), comes
        # after the MLP's and the output projection's, whose saved (or rebuilt) tensors are freed by then.
        freed, scores = mb.attention_freed, scores_kept(run.model, act)
        attention = BlockMoment("attention", w2.grads, w2.buffers, a_none - freed + stream + cast + mb.attention)
        if not wrapped:
            mlp = mb.mlp_new - mb.mlp_freed
            fused_attention = 0 if scores else mb.attention
            moments = [BlockMoment("mlp", w2.grads, w2.buffers,
                                   a_none + stream + cast + max(fused_attention, mlp + w2.in_flight))]
            moments += [attention] if scores else []
            if fp8_backward:  # before any of the block's weight gradients exists
                moments.append(BlockMoment("fp8 casts", 0, 0, a_none + stream + incoming + fp8_backward))
            moments += first_linear_moments(stream)
            if dequant:  # the block's first backward matmul (the MLP's output linear), before its gradients
                moments.append(BlockMoment("nf4 dequant", 0, 0, a_none + stream + cast + dequant))
            for r in routed_moments:
                grads, buffers = routed(r.done)
                acts = a_none - shared_kept - shared_rebuilt - r.freed + stream + r.added
                moments.append(BlockMoment("routed experts", grads, buffers, acts, -r.uncast))
            return moments
        kept = a_policy - mb.released + stream
        moments = [
            BlockMoment("recomputed", 0, rebuild + mb.recompute_tail, kept + mb.branch_grad + mb.released_last),
            BlockMoment("mlp", w2.grads, w2.buffers + rebuild - mb.mlp_freed, kept + cast + mb.mlp_new + w2.in_flight),
        ]
        if fp8_backward:
            moments.append(BlockMoment("fp8 casts", 0, rebuild, kept + incoming + fp8_backward))
        moments += first_linear_moments(stream, kept)
        if dequant and policy == "full":  # the recompute's last NF4 linear (its input, saved by none)
            recompute_input = c * st.tokens * max(linears_in[name] for name in run.layout.adaptation.quantized)
            moments.append(BlockMoment("nf4 dequant", 0, rebuild + dequant + recompute_input,
                                       kept + max(cast, mb.branch_grad)))
        elif dequant:  # selective: the linears are not recomputed; the first backward matmul
            moments.append(BlockMoment("nf4 dequant", 0, rebuild, kept + cast + dequant))
        if scores:  # the kept tensors and the recompute's, less what the MLP's backward freed
            moments.append(BlockMoment("attention", w2.grads, w2.buffers + max(0, rebuild - freed),
                                       kept + cast + mb.attention))
        for r in routed_moments:
            grads, buffers = routed(r.done)
            acts = kept - shared_kept + r.added - r.freed_kept
            moments.append(BlockMoment("routed experts", grads, buffers + rebuild - shared_rebuilt
                                       - (r.freed - r.freed_kept), acts, -r.uncast))
        return moments

    # ZeRO-3 (not ZeRO-2, nor ZeRO-3 under a split-backward schedule: train/parallelize.py's
    # reshard_after_forward=False): every block reshards after its forward and is gathered again for its
    # backward. Prefetched, its all-gathers' outputs exist before it runs, but for routed experts on one
    # edp rank: their "all-gather" over one rank is the copy-out, made only once the block waits for it.
    gather = copy if st.fsdp and not kept_unsharded else 0
    whole_experts = c * lay.block_experts if gather and run.layout.zero_shards <= run.layout.ep else 0
    computed: dict[bool, list[BlockMoment]] = {}

    def moments(wrapped: bool) -> list[BlockMoment]:  # the stage's first, last and middle blocks ask alike
        if wrapped not in computed:
            computed[wrapped] = in_backward(wrapped)
        return computed[wrapped]

    return BlockSide(moments, a_none, a_policy, cast_block, copy, gather, gather - whole_experts, block_grads,
                     lay.block, lay.block_experts, nf4_gathered, dequant)


@functools.lru_cache(maxsize=1024)
def _middle_blocks(order: tuple[tuple[int, bool], ...]) -> tuple[tuple[int, tuple[tuple[tuple[int, bool], int], ...]],
                                                                 ...]:
    """The stage's blocks between its first and its last whose backward moments can be the largest, each with
    the blocks after it counted by (kind, wrapped). From one block of a kind and policy to the next of the
    same, the held state changes by the activations of the blocks between and the gradients of those after:
    the same amount each time where the layers repeat a pattern, so a kind's largest is at its first or its
    last; its first two and last two are weighed, for a pattern that starts otherwise (the first k layers
    dense). Cached: the stages of a plan's layouts repeat."""
    positions: dict[tuple[int, bool], list[int]] = {}
    for i in range(1, len(order) - 1):
        positions.setdefault(order[i], []).append(i)
    chosen = sorted({i for at in positions.values() for i in (*at[:2], *at[-2:])})
    return tuple((i, tuple(collections.Counter(order[i + 1:]).items())) for i in chosen)


def passed_on_sent(run: Run, lay: RankLayout, mb: MicroBatch, sent: int) -> int:
    """PipelineHeld.sent (`sent`) on a pipeline rank whose stage holds no block, nor the embedding or the
    head (nanotron's split leaves such ranks): its output is its input slot's storage
    (parallel/pipeline._PassOn), so only the input gradients it sends are its own, one per backward
    (autograd's AccumulateGrad copies the received output gradient into the input's `.grad`: the slot
    keeps a reference). torch holds them as it holds a sent tensor: Schedule1F1B its last (`bwd_sends`)
    beside the one just made, ScheduleGPipe all of them until the step's end (`bwd_sends_to_wait`).
    Several stages a rank, or another engine's buffers: `sent` as it is (it counts the outputs: a bound)."""
    layout = run.layout
    if lay.blocks or lay.first or lay.last or not SCHEDULES[layout.pp_schedule].single_stage \
            or run.engine.pipeline_buffers != "preallocated":
        return sent
    m = layout.num_microbatches
    return mb.boundary * (min(m, 2) if layout.pp_schedule == "1f1b" else m)


def rank_breakdown(run: Run, common: LayoutCommon, lay: RankLayout) -> Callable[[PipelineHeld], MemoryBreakdown]:
    """A rank's breakdown, a pure function of what the ranks share and of its own (lay, pipe), as a
    function of what its pipeline schedule holds (pipe): ranks of one RankLayout share all the rest."""
    st = stage_states(run, common, lay)
    mb, prec, act = common.micro_batch, st.prec, st.prec.act

    # ---- activations of one micro-batch (each block's of its own kind of layer), and of those in flight
    held_acts = held_activations(run, common, lay, st)
    a_blocks, a_final = held_acts.blocks, held_acts.final
    chunked = run.layout.chunked_loss
    loss = mb.loss if lay.last else LossBytes(0, 0, 0, 0)

    # ---- compute copies, communication and module buffers
    c = prec.compute
    cast_head = c * lay.output_matmul if act.autocast else 0  # fp8-mixed: the output projection stays bf16
    # (PEFT: autocast caches the casts of leaves that require grad only, but autograd saves a frozen
    # weight's cast for its input's gradient: the base's casts are held as long, freed as its backward
    # passes them; counted whole, as cached casts are)
    # ZeRO-2, and ZeRO-3 under a split-backward schedule (train/parallelize.py): reshard_after_forward=False
    kept_unsharded = st.fsdp and (run.layout.zero_stage == 2 or run.layout.splits_backward)
    all_fp8_gathered = (lay.summed.float8 * (c - 1) if run.layout.fp8_gathers else 0) + lay.summed.nf4 * c - \
        lay.summed.nf4_bytes
    held = c * st.params - all_fp8_gathered if kept_unsharded else 0
    # ZeRO-3: FSDP2 never reshards the root (embeddings, final norm, output); every block reshards
    # after its forward, so blocks are gathered only while one runs (with its prefetched neighbour).
    zero3 = st.fsdp and not kept_unsharded
    root_gather = c * (lay.embedding + lay.head) if zero3 else 0
    reduce = (FSDP_REDUCE_BYTES_MIXED if prec.mixed else prec.param) if st.fsdp else 0
    # Context parallelism's causal masks, each sliding window's mask (one in the queries' dtype, shared by
    # the layers of that window: models/common.window_mask), and each RoPE setting's cos/sin tables
    persistent_buffers = context_parallel_mask_bytes(st.seq, run.layout.cp, act.compute)
    arch = describe(run.model)
    window_masks = 0 if act.packed_rows else len(arch.masked_windows(st.seq)) * st.seq * st.seq * act.compute
    # (packed rows' document masks replace the windows': micro_batch.MicroBatch.positions); SDPA saves the window's
    # mask for its backward, the eager attention does not: its masks die with the model's forward
    persistent_buffers += 0 if act.eager_attention else window_masks
    forward_masks = mb.forward_masks + (window_masks if act.eager_attention else 0)
    persistent_buffers += len(arch.rope_keys) * 2 * run.model.max_seq_len * arch.attention.head_dim * \
        rope_table_bytes(run)
    kind = run.layout.data_parallel
    if kind == "ddp" and not DDP_GRADIENT_AS_BUCKET_VIEW:
        persistent_buffers += st.grads  # DDP's gradient buckets, beside the gradients
    # (and the pipeline's receive slots, all step long; the forward and backward buffers: its sends)
    fwd_buffers = persistent_buffers + root_gather
    # FSDP's unsharded gradients of the root (output projection, final norm; a tied embedding's
    # too), reduce-scattered when the backward ends; a block's own are in its side's moments.
    root_grads = lay.head + (lay.embedding if lay.tied_here else 0)
    bwd_buffers = persistent_buffers + root_gather + (c * root_grads if st.fsdp else 0)

    # ---- gradients present before this micro-batch's backward: accumulation or pipelining
    m = run.layout.num_microbatches
    accumulating = run.layout.grad_accum_steps > 1 if run.layout.pp == 1 else m > lay.in_flight
    # Gradients that are buckets (DDP's gradient_as_bucket_view, ZeRO-1's buffers) exist from the
    # step's start; autograd's gradient is moved into its bucket as soon as it is made, so nothing
    # else of a parameter's gradient outlives its own backward.
    bucketed = kind == "zero1" or (kind == "ddp" and DDP_GRADIENT_AS_BUCKET_VIEW)
    # DDP accumulating: the micro-batches before the last run without gradient sync, when DDP's hook
    # does nothing and autograd accumulates into new `.grad` tensors (set_to_none dropped the views);
    # the last one's hook copies each into its bucket slot as the parameter's backward finishes and
    # makes `.grad` the slot's view. Until then both exist: all of them up to the head's backward,
    # then those of the parameters still ahead (`pending`, in elements).
    # FSDP under a pipeline schedule: no sharded gradient exists before the step's reduce-scatter;
    # the accumulated unsharded ones do, those of the blocks already backwarded in this micro-batch,
    # or of all of them once a micro-batch is done: the parameters' own `.grad` (grads) when they
    # are in the reduce dtype, else FSDP2's reduce-dtype copy (buffers, as its other staging).
    # Bytes per element of the gradients autograd makes (the module's parameters' dtype) and of
    # those held in `.grad` until the step (none beyond the buckets when bucketed).
    autograd_bytes = c if st.fsdp or kind == "zero1" else st.grads / st.params if st.params else 0
    per_param = 0 if bucketed else st.grads / st.params if st.params else 0
    # A tied weight's gradient stays in autograd's accumulation buffer until the embedding's
    # backward adds its share (FSDP2 reduces it as an unsharded gradient, in bwd_buffers).
    tied_pending = int(lay.embedding * autograd_bytes) if lay.tied_here and not st.fsdp else 0
    holding = GradientHolding(autograd_bytes, per_param, bucketed, tied_pending)

    # ---- the blocks whose backward moments are weighed: the stage's last, its first and, where they can
    # be larger, some between them (each sized by its own kind of layer)
    sides: dict[int, BlockSide] = {}

    def side(k: int) -> BlockSide:
        if k not in sides:
            sides[k] = _block_side(*common.at_kind(lay, k), st, holding)
        return sides[k]

    order = lay.block_order
    last = side(lay.moment_kind)
    first = side(order[0][0]) if order else last
    # ZeRO-3 in a block's backward: the block gathered, and the next one prefetched unless this is
    # the first block (the last to run); FSDP2 also holds the previous block's reduce-scatter input
    # until it issues the next one.
    def gathered(i: int) -> int:
        """The gathered blocks at the backward of the stage's block i: its own, and the next ones to run
        backward prefetched (the blocks before it)."""
        return side(order[i][0]).gather + sum(side(k).prefetched for k, _ in order[max(0, i - FSDP_PREFETCH_BLOCKS):i])

    last_comms = gathered(len(order) - 1) if order else 0
    after_first = side(order[1][0]).grad_elements if len(order) > 1 else first.grad_elements
    first_comms = first.gather + (reduce * after_first if st.fsdp and lay.blocks > 1 else 0)
    # FSDP under a pipeline schedule: torch's stage runs every backward with gradient sync and
    # resharding after backward off (stage.py backward_maybe_with_nosync) and reduce-scatters once,
    # after the step's last micro-batch (perform_reduce_grad). Each unit's gradients accumulate
    # unsharded in the reduce dtype (FSDP2's unsharded_accumulated_grad) from its first backward,
    # and its parameters stay gathered after each backward until its next forward reshards them.
    pp_fsdp = st.fsdp and run.layout.pp > 1
    if pp_fsdp:
        first_comms = c * lay.summed.params if zero3 else 0  # every block backwarded: still gathered

    # Sharded gradients (FSDP) exist once reduce-scattered: the root's after the whole backward.
    output_grads = 0 if st.fsdp or bucketed else int(root_grads * per_param) - tied_pending
    shards, ep = run.layout.zero_shards, run.layout.ep
    on_shard = on_zero_shard(st.params, lay.summed.experts, shards, ep) if st.fsdp and st.params else 0

    def sharded_grads(params: int, experts: int) -> int:
        """The gradients (bytes) on the rank of `params` elements backwarded (`experts` of them routed
        experts' weights), as the step holds them: FSDP's sharded ones (routed experts are sharded over
        fewer ranks, edp, than the rest, so a block holds a larger share of the rank's gradients than of
        its parameters), else `.grad`."""
        if on_shard:
            return st.grads * on_zero_shard(params, experts, shards, ep) // on_shard
        return int(params * per_param)

    later = st.params - first.params - (0 if lay.tied_here else lay.embedding) - (root_grads if st.fsdp else 0)
    later_sharded = sharded_grads(later, lay.summed.experts - first.experts) - (0 if on_shard else tied_pending)

    def earlier(acc: bool, share: float) -> Earlier:
        """The gradients of earlier backwards as one backward sees them: `acc`, some ran before it,
        making `share` of the rank's gradients (a pipeline rank's local stages: one of them)."""
        separate = st.grads / st.params if kind == "ddp" and bucketed and acc and st.params else 0
        before = int(share * st.grads) if acc or bucketed else 0
        accumulated = int(share * reduce * st.params) if pp_fsdp and acc else 0
        staged, comms, later_grads = 0, first_comms, 0 if bucketed else later_sharded
        if pp_fsdp:
            before = 0 if prec.mixed else accumulated
            staged = accumulated if prec.mixed else 0
            if not acc and prec.mixed:
                comms += reduce * (later + root_grads)
            elif not acc:
                later_grads = reduce * (later + root_grads)
        # The output projection's weight gradient in flight: bucketed, until the bucket's hook takes
        # it; accumulating, until autograd adds it to the `.grad` already there
        head_grad = 0
        if (bucketed or acc and not st.fsdp) and lay.last and not chunked:
            # and the projection's input gradient (grad_logits @ W: [tokens, dim], the matmul's
            # dtype), made by the same autograd node; under tensor parallelism a whole partial sum
            head_grad = int(autograd_bytes * lay.output_matmul) + (c * lay.output_matmul if act.autocast else 0) \
                + c * run.model.dim * st.tokens
        return Earlier(before, separate, staged, later_grads, comms, head_grad, acc)

    # Each moment is weighed in the step's: gradients made in the block may count less there (those
    # accumulated before already hold them: max(g.before, ...) below).
    last_moments, first_moments = last.moments(lay.last_wrapped), first.moments(lay.first_wrapped)

    # A tied embedding and output projection trained in full, on a rank that holds whole gradients
    # (FSDP2 reduce-scatters the root's as its backward ends): see the moment below.
    tied_embedding_grad = 2 * lay.embedding * prec.param if lay.first and lay.tied_here and not st.fsdp \
        and not run.layout.adaptation else 0

    h_if = lay.head_in_flight
    older_own = held_acts.older  # other micro-batches in flight
    # Autocast caches one cast per parameter for its whole block, and a pipeline step runs every
    # micro-batch in one (TrainStep.pipeline_forward_backward): the other micro-batches add none.
    # Its backward runs inside the block too, where one process's runs after it: every cast stays.
    uncast = c * first_block_casts_unsaved(run, lay, act)
    def casts(wrapped: bool | None) -> int:  # the blocks' casts (all, or of those the policy leaves), each its own
        return int(common.per_kind(lay, lambda _, k: c * (k.block.matmul - k.block.float8 - k.block.nf4),
                                   wrapped=wrapped)) if act.autocast else 0

    saved_casts = casts(False) + cast_head - uncast
    all_casts, pipelined = casts(None) + cast_head - uncast, run.layout.pp > 1
    states = resident_states(st)

    # A block between the stage's first and last, at its backward: the blocks before it still hold what
    # they saved (and the casts autocast made for them), those after it have made their gradients and
    # freed their activations, its own moments are its kind's (BlockSide.moments); under FSDP it is
    # gathered beside the next one prefetched and the previous one's reduce-scatter input (ZeRO-2: the
    # blocks after it are resharded after their backward). Sums over the blocks after it (`after_*`).
    unwrapped_casts = casts(False)
    middle = []  # (position, its side, its saved bytes, sums over the blocks after it)
    for i, after in _middle_blocks(order):
        s, wrapped = side(order[i][0]), order[i][1]
        sums = [0, 0, 0, 0, 0]  # saved, parameters, experts' weights, compute copies, unwrapped casts
        for (k, w), n in after:
            b = side(k)
            for j, value in enumerate((b.kept if w else b.saved, b.params, b.experts, b.copy, 0 if w else b.cast)):
                sums[j] += n * value
        middle.append((i, s, s.kept if wrapped else s.saved, *sums))
    kind_moments = {order[i]: s.moments(order[i][1]) for i, s, *_ in middle}

    def middle_moments(g: Earlier, older: float, logits: float, bwd: int) -> list[Moment]:
        """The moments of the middle blocks (`middle`), of each kind and policy at its block whose held
        state (with its own largest gradients) is the largest."""
        best: dict[tuple[int, bool], tuple[float, int, float, float, int, int, int]] = {}
        for i, s, own_saved, a_after, p_after, e_after, copy_after, casts_after in middle:
            wrapped = order[i][1]
            params = (held if pp_fsdp else held - copy_after if held else 0) + (all_casts if pipelined else
                unwrapped_casts - casts_after - (0 if wrapped else s.cast) - uncast + s.cast)
            acts = older + a_blocks - a_after - own_saved
            comms = gathered(i)
            if pp_fsdp:  # the blocks after it still gathered, their unsharded accumulations
                comms += c * p_after if zero3 else 0
                accumulations = reduce * (p_after + root_grads)
                grads = sharded_grads(p_after, e_after) if g.acc else 0 if prec.mixed else accumulations
                comms += accumulations if not g.acc and prec.mixed else 0
            else:
                comms += reduce * side(order[i + 1][0]).grad_elements
                grads = output_grads + (0 if bucketed else sharded_grads(p_after, e_after))
            pending = g.pending(st.params - lay.head - p_after)
            own = max((b.grads for b in kind_moments[order[i]]), default=0)
            weight = params + acts + max(g.before, grads + own) + pending + comms
            if order[i] not in best or weight > best[order[i]][0]:
                best[order[i]] = (weight, i, params, acts, grads, comms, p_after)
        moments = []
        for key, (_, i, params, acts, grads, comms, p_after) in best.items():
            pending = g.pending(st.params - lay.head - p_after)
            moments += [Moment("backward", f"block {i + 1} of {len(order)}: {b.what}", params + b.casts,
                               acts + b.activations, logits, max(g.before, grads + b.grads) + pending,
                               bwd + comms + b.buffers)
                        for b in kind_moments[key]]
        return moments

    # A pipeline rank whose forwards all precede its backwards (m <= in_flight: GPipe, 1F1B's early
    # ranks, a short step) backwards its micro-batches one after the other: the first with every
    # micro-batch held and no gradient, each following one with a chunk (one micro-batch through one
    # local stage) fewer held and the gradients of the chunks done. The second chunk backward is the
    # largest of the following ones (they all see the local stage's gradients; each holds a chunk
    # fewer): its moments are the rank's too. Zero-bubble schedules count the gradients a deferred
    # weight pass has yet to make (the pending inputs are in pipe.pending as well): a bound.
    v = run.layout.pp_virtual_stages
    following = run.layout.pp > 1 and not accumulating and run.layout.num_microbatches * v > 1
    backwards = [(earlier(accumulating, 1.0), 0.0, 0)]
    if following:
        backwards.append((earlier(True, 1 / v), 1 / v, 1 if lay.head_in_flight > 1 else 0))

    def with_pipeline(pipe: PipelineHeld) -> MemoryBreakdown:
        # The pipeline's last stage holds each in-flight micro-batch's logits (the current one's
        # through its backward too), where one process frees them once the loss is computed, and what
        # its loss saved (the loss region's: logits).
        own_logits = pipe.logits
        # The chunked loss holds the output through its own backward (one process: only then).
        loss_bwd = loss.backward + (loss.output if loss.keeps_output and not own_logits else 0)
        g = backwards[0][0]
        older = older_own + pipe.pending
        older_logits = (h_if - 1) * (pipe.logits + loss.saved)
        acts = older + a_blocks + a_final
        sends = pipe.slots + passed_on_sent(run, lay, mb, pipe.sent)
        fwd = fwd_buffers + g.staged + sends
        ahead = g.before + g.pending(st.params)  # every gradient before the backward's first
        moments = [
            # End of the model's forward: autocast's cache still holds checkpointed blocks' casts.
            Moment("forward", "end of forward", held + all_casts, acts + forward_masks,
                   older_logits + loss.output, ahead, fwd),
            Moment("forward", "loss", held + saved_casts, acts, older_logits + loss.forward, ahead, fwd),
            # (QLoRA: the last block's forward, dequantizing its largest NF4 weight; a bound: the whole block saved)
            *([Moment("forward", "last block's nf4 dequant", held + all_casts, acts - a_final + last.dequant,
                      older_logits, ahead, fwd)] if last.dequant else []),
        ]
        for g, chunks_done, heads_done in backwards:
            older = older_own - chunks_done * a_blocks - heads_done * a_final + pipe.pending
            older_logits = (h_if - 1 - heads_done) * (pipe.logits + loss.saved)
            acts = older + a_blocks + a_final
            fwd, bwd = fwd_buffers + g.staged + sends, bwd_buffers + g.staged + sends
            ahead = g.before + g.pending(st.params)
            moments += [
                Moment("backward", "loss", held + saved_casts, acts, older_logits + own_logits + loss_bwd, ahead, fwd),
                # The output projection's backward (head_grad), its weight gradient just made (under
                # autocast also its 16-bit form) beside the logits' gradient in the compute dtype, until
                # the bucket's hook or the accumulation takes it (a large vocabulary makes this the
                # backward's peak).
                *([Moment("backward", "output projection", held + saved_casts, acts + g.head_grad,
                          older_logits + max(own_logits, loss.output), ahead, fwd)] if g.head_grad else []),
            ]
            moments += [
                Moment("backward", f"last block: {b.what}",
                       held + (all_casts if pipelined else saved_casts - cast_head
                               + (last.cast if lay.last_wrapped else 0)) + b.casts,
                       older + a_blocks - (last.kept if lay.last_wrapped else last.saved) + b.activations,
                       older_logits + own_logits,
                       max(g.before, output_grads + b.grads) + g.pending(st.params - lay.head),
                       bwd + last_comms + b.buffers)
                for b in last_moments if lay.blocks]  # a stage of the head alone has no block to backward
            moments += middle_moments(g, older, older_logits + own_logits, bwd)
            # (under a pipeline schedule FSDP keeps every backwarded block gathered: all of them, held;
            # accumulating, autograd adds the block's new weight gradients into the `.grad` there)
            # (what the blocks share, mb.positions, lives until the first block's RoPE backward: past its
            # attention, before its query projection's)
            moments += [
                Moment("backward", f"first block: {b.what}",
                       (held if pp_fsdp else c * (first.params + lay.embedding + lay.head) - first.nf4_gathered
                        if held else 0)
                       + (all_casts if pipelined else first.cast) + b.casts,
                       older + b.activations + (0 if b.what.startswith("wq") else mb.positions),
                       older_logits + own_logits,
                       max(g.before, g.later_grads + b.grads) + g.pending(first.params + lay.embedding),
                       bwd + g.first_comms + b.buffers)
                for b in first_moments if lay.blocks]
            if tied_embedding_grad:
                # The embedding's backward, the step's last: a tied weight's gradient already holds the
                # output projection's, every other gradient is made, and the embedding's own [V, D]
                # gradient is summed into it (the incoming and the sum, until the sum replaces it).
                moments.append(Moment("backward", "tied embedding", 0, older + tied_embedding_grad, older_logits,
                                      max(g.before, st.grads), bwd))
        moments += [
            # The step: every gradient (ZeRO-1's master gradients too) and the optimizer's temporaries.
            Moment("optimizer", "step", 0, 0, 0, st.grads + st.master_grads,
                   persistent_buffers + pipe.slots + st.optimizer_temp),
        ]
        phase_peaks: dict[str, int] = {}
        at, peak = moments[0], -1
        for moment in moments:
            total = states + int(moment.total())
            phase_peaks[moment.phase] = max(phase_peaks.get(moment.phase, 0), total)
            if total > peak:
                at, peak = moment, total
        terms = reserved_margin_terms(run.hardware, peak, common.comm_buffers)
        return MemoryBreakdown(
            params=int(at.params) + st.compute_params + (0 if prec.mixed else st.persistent),
            master_params=st.persistent if prec.mixed else 0,
            grads=int(at.grads), optimizer=st.optimizer, activations=int(at.activations), logits=int(at.logits),
            buffers=int(at.buffers), peak=peak, peak_phase=at.phase, reserved_margin=sum(terms.values()),
            margin_terms=terms,
            phase_peaks=phase_peaks,
        )

    return with_pipeline
