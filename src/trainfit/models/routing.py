"""How many tokens each routed expert processes: the one place the model (moe.py), the analytic
estimator (memory/closed_form/block/activations.py) and the traced one (traced.py) get it from. Torch-free.

- Capacity (model.capacity_factor > 0): every expert runs on a buffer of exactly `capacity` rows,
  the tokens routed to it up to that many, padded when fewer arrive; memory is fixed by the config.
- Dropless (capacity_factor = 0): each expert runs on the tokens routed to it. Their total is always
  tokens x top_k; the split is the router's. Memory is estimated with the busiest expert at
  memory.moe_imbalance times the balanced load, placed where it costs most (dropless_loads).
- Expert parallelism (parallel/expert.py): a rank runs its num_experts / ep experts on the rows
  every rank of its group sends them; dropless, the busiest rank's (expert_parallel_loads).
"""

from __future__ import annotations

import math


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows of each expert's buffer: ceil(capacity_factor x tokens x top_k / experts) (Switch
    Transformer, Fedus et al., arXiv 2101.03961, Sec. 2.2), never more than the tokens (a token
    picks an expert once)."""
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def dropless_loads(num_tokens: int, top_k: int, num_experts: int, imbalance: float) -> list[int]:
    """Tokens per expert, in the order moe.GroupedExperts runs them, with the busiest at `imbalance`
    x the balanced load (at most every token; `imbalance` may be inf) in its worst place.

    Backward runs the experts in reverse. Each expert's backward returns its slice of the stacked
    weights' gradients as full-size tensors that autograd sums out of place: from the second expert
    backward on, the three running sums plus a new slice and a new sum exist at once, on top of the
    saved tensors of every expert not yet done; and the busiest expert's own gradients are largest
    on top of those. So the last two experts are as light as the others allow (an empty second
    expert backward has the summing moment on everything saved) and the busiest comes third from
    last (its backward on everything saved too); the rest share what remains, none above the
    busiest.
    """
    routed = num_tokens * top_k
    busiest = math.ceil(min(num_tokens, max(1.0, imbalance) * routed / num_experts))
    if num_experts == 1:
        return [routed]
    rest = routed - busiest
    num_tail = min(2, num_experts - 1)
    num_middle = num_experts - 1 - num_tail
    tail = max(0, rest - num_middle * busiest)  # what the middle experts cannot hold
    return [*_even(rest - tail, num_middle), busiest, *_even(tail, num_tail)]


def _even(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def expert_parallel_loads(num_tokens: int, top_k: int, num_experts: int, ep: int, imbalance: float) -> list[int]:
    """Dropless expert parallelism: rows each local expert of the busiest rank of an expert group
    receives, in the order it runs them, when every rank's micro-batch of num_tokens routes as
    dropless_loads says (one router: their busiest expert is the same one) and the busiest rank holds
    the num_experts / ep experts loaded most (in dropless_loads' order). Balanced (imbalance 1): the
    rank's own tokens x top_k; at the ceiling, ep times its experts' whole load."""
    loads = dropless_loads(num_tokens, top_k, num_experts, imbalance)
    heaviest = sorted(range(num_experts), key=lambda e: -loads[e])[:num_experts // ep]
    return [ep * loads[e] for e in sorted(heaviest)]
