"""How many tokens each routed expert processes: the one place the model (moe.py), the analytic
estimator (memory/activations.py) and the traced one (memory/traced.py) get it from. Torch-free.

- Capacity (model.capacity_factor > 0): every expert runs on a buffer of exactly `capacity` rows,
  the tokens routed to it up to that many, padded when fewer arrive; memory is fixed by the config.
- Dropless (capacity_factor = 0): each expert runs on the tokens routed to it. Their total is always
  tokens x top_k; the split is the router's. Memory is estimated with the busiest expert at
  memory.moe_imbalance times the balanced load, the others sharing the rest.
"""

from __future__ import annotations

import math


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows of each expert's buffer: ceil(capacity_factor x tokens x top_k / experts) (Switch
    Transformer, Fedus et al., arXiv 2101.03961, Sec. 2.2), never more than the tokens (a token
    picks an expert once)."""
    return min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def dropless_loads(num_tokens: int, top_k: int, num_experts: int, imbalance: float) -> list[int]:
    """Tokens per expert, in the order moe.GroupedExperts runs them, for the worst place of a busiest
    expert at `imbalance` x the balanced load (at most every token).

    Backward runs the experts in reverse. Each expert's backward returns its slice of the stacked
    weights' gradients as full-size tensors, which autograd sums out of place: from the second
    expert backward on, the three sums plus one new slice and one new sum exist at once, on top of
    the saved tensors of every expert not yet done. So the worst is the busiest expert second to
    last (the second backward, its transients on everything saved but the last expert's) and the
    last expert as light as possible (holding no more than the busiest); the others share the rest.
    """
    routed = num_tokens * top_k
    busiest = min(num_tokens, max(math.ceil(routed / num_experts), math.ceil(imbalance * routed / num_experts)))
    if num_experts == 1:
        return [routed]
    rest = routed - busiest
    last = max(0, rest - (num_experts - 2) * busiest)
    middle, n = rest - last, num_experts - 2
    return [middle // n + (e < middle % n) for e in range(n)] + [busiest, last]
