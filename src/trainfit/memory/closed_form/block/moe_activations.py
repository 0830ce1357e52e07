"""What an MoE feed-forward saves and makes in backward: its routing (`Routing`: rows per token of the
routed experts, dropless or with a capacity factor, under expert parallelism), the router's, routed and
shared experts' saved tensors, and the moments of the routed experts' backward (`routed_backward_moments`),
where the experts' stacked weight gradients are summed. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    FP32,
    INDEX,
    ActDtypes,
    Terms,
    Transient,
    expert_glu_saved,
    swiglu_saved,
)
from trainfit.models.checkpoint_policy import kept_linear_shares
from trainfit.models.routing import dropless_loads, expert_capacity, expert_parallel_loads

# torch.nonzero(as_tuple=True) returns views of one (M, 2) int64 result, which both the
# index_select and the gather of routing weights save: 16 bytes per routed token.
ROUTED_INDEX_BYTES = 2 * INDEX


# Dropless expert parallelism: per received row the expert-major order and its inverse (int64,
# each saved by an index_select); per own pair its token and its place in the expert order.
EP_RECEIVED_INDEX_BYTES = EP_PAIR_INDEX_BYTES = 2 * INDEX


ROUTED_WEIGHT_GRAD_COPIES = (3, 5)
"""Dropless MoE backward, in stacked expert weights ([E, F, D] each): moe.GroupedExperts uses
expert e's slice `w1[e]`, whose backward (select_backward) returns a zero-filled full-size gradient
of the stacked weight; autograd sums those across the experts out of place. From the first expert's
backward to the layer's last, the running sums of w1, w2 and w3 exist (3); while an expert's slice
gradient is added to one of them, the new full-size slice and the new sum too (5). Read off the
torch 2.13 autograd graph (SelectBackward0, InputBuffer::accumulate) and measured on CPU."""


@dataclass(frozen=True)
class Routing:
    """How many rows a micro-batch's routed experts process, per token of the micro-batch."""

    rows: float
    """Expert rows in all: top_k (dropless: each token's k passes) or E x capacity / tokens (the
    capacity buffers, padding included)."""
    busiest: float
    """Rows of the largest single expert computation: dropless, the busiest expert's (the experts
    run one after the other); capacity, all E x capacity (one batched matmul for all experts)."""
    capacity: bool
    tail: float = 0.0
    """Dropless: rows of each of the two experts whose backward runs first (the last two; as light
    as the imbalance allows, routing.dropless_loads), whose saved tensors are freed by then."""
    pairs: float = 0.0
    """Dropless expert parallelism: the rank's own (token, choice) pairs (top_k), which its experts'
    outputs come back as; `rows` are then the rows its experts receive. 0 without it."""
    ep: int = 1
    """Expert-parallel degree: the rank runs num_experts / ep experts, between two all-to-alls."""

    @property
    def returned(self) -> float:
        """Rows per token the combine all-to-all brings back: the pairs (dropless), the slots (capacity)."""
        return self.pairs or self.rows

    def local_experts(self, num_experts: int) -> int:
        return num_experts // self.ep


def moe_routing(m: ModelConfig, num_tokens: int, imbalance: float, ep: int = 1) -> Routing | None:
    """The routing of one MoE layer on `num_tokens` tokens (a rank's micro-batch), None for dense
    models; `imbalance` is memory.moe_imbalance (dropless only); `ep` the expert-parallel degree
    (capacity: a rank's experts take ep sources' buffers of their capacity, E x capacity rows in
    all; dropless: the busiest rank's)."""
    if not m.num_experts:
        return None
    E, k = m.num_experts, m.experts_per_token
    if m.capacity_factor:
        rows = E * expert_capacity(num_tokens, k, E, m.capacity_factor) / num_tokens
        return Routing(rows=rows, busiest=rows, capacity=True, ep=ep)
    if ep > 1:
        loads = expert_parallel_loads(num_tokens, k, E, ep, imbalance)
        return Routing(rows=sum(loads) / num_tokens, busiest=max(loads) / num_tokens, capacity=False,
                       tail=loads[-1] / num_tokens, pairs=k, ep=ep)
    loads = dropless_loads(num_tokens, k, E, imbalance)
    return Routing(rows=k, busiest=max(loads) / num_tokens, capacity=False, tail=loads[-1] / num_tokens)


def balanced_routing(m: ModelConfig) -> Routing:
    """Dropless and perfectly balanced: what the functions below assume when given no routing."""
    return Routing(rows=m.experts_per_token, busiest=m.experts_per_token / m.num_experts, capacity=False)


def moe_saved(m: ModelConfig, d: ActDtypes, r: Routing) -> Terms:
    """Router, top-k, the routed experts' rows (moe.GroupedExperts) and the shared experts."""
    E, k = m.num_experts, m.experts_per_token
    # softmax probs, top-k ids, and where they are renormalised (model.router_normalize_topk) the top-k
    # weights and their sum, which the division saves
    router = FP32 * E + INDEX * k + (FP32 * k + FP32 if m.router_normalize_topk else 0)
    # Per expert row: the expert's input (index_select; under autocast w1 and w3 (bmm) each save a
    # cast), 4 SwiGLU tensors, the routing weight, the w2 output and the weighted output y
    # (index_add_ saves it), plus its token index: dropless, the (M, 2) nonzero() result;
    # capacity, the slot's token (int64), and per (token, choice) pair the slot index that the
    # routing weights' scatter saves.
    per_row = routed_row_saved(m, d)
    if r.capacity:
        routed = r.rows * (INDEX + per_row) + k * INDEX
    elif r.pairs:  # expert parallelism: the experts' side per received row, the combine's per own pair
        routed = r.rows * (EP_RECEIVED_INDEX_BYTES + _expert_row_saved(m, d)) + \
            r.pairs * (EP_PAIR_INDEX_BYTES + _combine_row_saved(m, d))
    else:
        routed = r.rows * (ROUTED_INDEX_BYTES + per_row)
    shared = swiglu_saved(d.compute, m.num_shared_experts * m.expert_ffn_dim)
    return Terms(gathered=router + routed + shared)  # whole sequence, whole experts on every tp rank


def routed_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """What one expert row saves, its token index aside (see moe_saved)."""
    return _expert_row_saved(m, d) + _combine_row_saved(m, d)


def _expert_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """The expert's side of a row: its input (or autocast's two casts of it) and the SwiGLU's four."""
    x_in = 2 * d.compute * m.dim if d.autocast else d.stream * m.dim
    return x_in + expert_glu_saved(m, d.compute)


def _combine_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """The combine's side of a row: its routing weight, the w2 output and the weighted output."""
    return d.stream + d.compute * m.dim + d.stream * m.dim


@dataclass(frozen=True)
class RoutedMoment:
    """One moment of an MoE layer's routed-expert backward, in bytes (elements for `done`)."""

    done: int
    """Gradient elements complete: the shared experts' weights (their backward ran first), with a
    capacity factor also the stacked w2 (one batched matmul), then all three."""
    added: int
    """Added to the activations: the experts' gradients and autograd's running sums."""
    freed: int
    """Saved bytes of the layer already freed (the weighted output, index_add_'s): from the
    activations, or from the recompute of a checkpointed block."""
    uncast: int
    """16-bit weight casts already freed (autocast: each dropless expert frees its slices' own)."""
    freed_kept: int = 0
    """The part of `freed` that a checkpointed block's policy kept (not rebuilt by its recompute):
    expert parallelism's returned rows under the selective policies; with a capacity factor also the
    kept expert matmul outputs (_capacity_freed)."""


def routed_backward_moments(m: ModelConfig, d: ActDtypes, t: Transient, routing: Routing,
                            size: Callable[[Terms], int], *, expert_weight: int, grad_bytes: int,
                            num_local_experts: int, policy: str = "none", shared_weights: int | None = None
                            ) -> list[RoutedMoment]:
    """The candidate peaks of the routed experts' backward (the shared experts' saved tensors are
    freed by then: shared_experts_saved). `expert_weight`: elements of one stacked expert weight
    on the rank; `grad_bytes`: bytes per element of the gradients the experts' slices produce (the
    sliced weights' dtype: fp32 masters under autocast, the unsharded compute copies under FSDP).

    Capacity: the output-gradient moment, then the SwiGLU gradients with w2's gradient done, then
    w1's backward with all three done (_capacity_freed: what each has freed).
    Dropless (ROUTED_WEIGHT_GRAD_COPIES): from the second expert backward on the three running sums
    and the layer input's gradient sum exist; then either an expert with no tokens summing its
    full-size slice gradients and input-gradient scatter (nothing of its own freed), or the busiest
    expert's own moments (routing.dropless_loads places it third from last, after two light ones:
    one and two experts' saved tensors and casts freed; `Routing.tail`).
    PEFT: `expert_weight` and `shared_weights` (the shared experts' gradient elements) are what
    trains of them, their adapters; the casts are the frozen weights' all the same."""
    shared_casts_of = 3 * m.num_shared_experts * m.expert_ffn_dim * m.dim  # whole on the tp ranks
    shared = shared_casts_of if shared_weights is None else shared_weights
    shared_casts = d.compute * shared_casts_of if d.autocast else 0  # freed with the shared experts' backward
    output, hidden, freed = size(t.expert_output), size(t.expert_hidden), size(t.expert_output_freed)
    if routing.capacity:
        # The shared experts' input gradient waits for the routed experts' (one sum, from then on).
        pending = size(t.expert_input_grad) if m.num_shared_experts else 0
        # Then the SwiGLU's gradients with w2's done, the combine's saved tensors freed; then w1's
        # backward, the last: every weight's gradient done, the gradient of w1's output and the two
        # partial input gradients (w3's, w1's) exist, the SwiGLU's saved tensors freed too.
        first_linears = size(Terms(gathered=routing.busiest * d.compute * (m.expert_ffn_dim + 2 * m.dim)))
        combine, combine_kept = _capacity_freed(m, d, routing, size, policy, swiglu=False)
        rows_saved, rows_kept = _capacity_freed(m, d, routing, size, policy, swiglu=True)
        return [RoutedMoment(shared, pending + output, freed, shared_casts),
                RoutedMoment(shared + expert_weight, pending + hidden, combine, shared_casts, combine_kept),
                RoutedMoment(shared + 3 * expert_weight, pending + first_linears, rows_saved, shared_casts, rows_kept)]
    unit = expert_weight * grad_bytes
    if routing.pairs:
        return _expert_parallel_moments(m, d, t, routing, size, shared=shared, shared_casts=shared_casts,
                                        expert_weight=expert_weight, unit=unit, policy=policy)
    copies, summing = ROUTED_WEIGHT_GRAD_COPIES
    input_grad = size(t.expert_input_grad)
    running, adding = copies * unit + input_grad, (summing - copies) * unit
    cast_expert = d.compute * 3 * expert_weight // max(1, num_local_experts) if d.autocast else 0
    busiest = max(output, hidden, adding + size(t.expert_accumulation))
    light = size(Terms(gathered=routing.tail * (ROUTED_INDEX_BYTES + routed_row_saved(m, d))))  # one light expert's
    return [RoutedMoment(shared, running + adding, light, shared_casts + cast_expert),
            RoutedMoment(shared, running + 2 * input_grad, 2 * light, shared_casts + 2 * cast_expert),
            RoutedMoment(shared, running + busiest, freed + 2 * light, shared_casts + 2 * cast_expert)]


def _capacity_freed(m: ModelConfig, d: ActDtypes, routing: Routing, size: Callable[[Terms], int], policy: str,
                    *, swiglu: bool) -> tuple[int, int]:
    """Capacity: (freed, the part a checkpointed block's policy kept) of the rows' saved tensors, once
    the combine's backward is done (the routing weight, the w2 output and the weighted output) and,
    with `swiglu`, at w1's backward, the experts' last: the SwiGLU's four too (all but the rows'
    input). Kept by the selective policies: the combine's w2 output, which is expert parallelism's
    returned rows (an all-to-all's output) or, on one rank, the kept w2 output; and w1's and w3's
    outputs by their kept shares."""
    D, F, c, rows = m.dim, m.expert_ffn_dim, d.compute, routing.busiest
    freed = rows * (_combine_row_saved(m, d) + (expert_glu_saved(m, c) if swiglu else 0))
    kept = 0.0
    if policy in ("selective", "selective-alternate"):
        share = kept_linear_shares(m, policy, routing.local_experts(m.num_experts), capacity=True)
        kept = rows * c * ((1.0 if routing.ep > 1 else share["experts_w2"]) * D
                           + ((share["experts_w1"] + share["experts_w3"]) * F if swiglu else 0))
    return size(Terms(gathered=freed)), size(Terms(gathered=kept))


def _expert_parallel_moments(m: ModelConfig, d: ActDtypes, t: Transient, routing: Routing,
                             size: Callable[[Terms], int], *, shared: int, shared_casts: int, expert_weight: int,
                             unit: int, policy: str) -> list[RoutedMoment]:
    """Dropless expert parallelism's routed backward (parallel/expert.py, in reverse): the combine's
    product with the routing weights (3 x the rank's pairs; the weighted output freed), its
    all-to-all (pairs + the rows received; the returned outputs freed), the return to expert order
    (2 x received); the experts one at a time under their output gradients (received), the busiest
    first at worst, before any other's is summed; then, every expert's weights done and saved rows
    freed, their input gradients concatenated and put back in received order (2 x received), before
    the dispatch's all-to-all (received + pairs). The shared experts' input gradient, if any, waits.
    The selective policies keep the returned rows (collectives' outputs), so a checkpointed block
    frees those from what it kept, not from its recompute."""
    D, s = m.dim, d.stream
    pairs, received = (size(Terms(gathered=rows * s * D)) for rows in (routing.pairs, routing.rows))
    pending = size(t.expert_input_grad) if m.num_shared_experts else 0
    copies, summing = ROUTED_WEIGHT_GRAD_COPIES
    busiest = max(size(t.expert_hidden), (summing - copies) * unit + size(t.expert_accumulation))
    experts_saved = size(Terms(gathered=routing.rows * (EP_RECEIVED_INDEX_BYTES + _expert_row_saved(m, d))))

    kept = pairs if policy in ("selective", "selective-alternate") else 0

    def at(added: int, freed: int, done: int = 0) -> RoutedMoment:
        return RoutedMoment(shared + done, pending + added, freed, shared_casts, min(freed - pairs, kept))

    return [at(3 * pairs, pairs), at(pairs + received, 2 * pairs), at(2 * received, 2 * pairs),
            at(received + copies * unit + busiest, 2 * pairs),
            at(2 * received, 2 * pairs + experts_saved, done=3 * expert_weight),
            at(received + pairs, 2 * pairs + experts_saved, done=3 * expert_weight)]
