"""What each activation-checkpointing policy keeps of a block, described once. Torch-free.

A policy wraps a block (or not) and, inside a wrapped block, keeps the outputs of some kinds of
operator and recomputes the rest in backward. The kinds are named here, not as torch operators:
trainfit.recompute maps each aten / c10d operator to its kind and asks `CheckpointPolicy.keeps`;
the memory estimate (memory/closed_form/block/activations.py) and the recompute FLOPs (perf/flops.py) read the same
answers per linear of models/block_spec.py (`kept_linear_shares`), so none of them can keep a
different tensor from the others.

- none: wraps nothing; every block saves what autograd saves.
- full: keeps only the block input (what the checkpoint itself saves).
- selective: the outputs of every matmul, of the fused attention kernel (with its logsumexp), of
  tensor parallelism's reductions of row-parallel outputs (reduce-scatter, all-reduce: recomputing
  a collective would communicate again; all-gathers are recomputed, as Megatron re-gathers) and of
  expert parallelism's all-to-alls; norms, activations, RoPE, casts and residual adds are recomputed.
- selective-alternate (torchtitan's "op" policy): the same, but of the matmuls only every other one,
  counted 1, 2, 3, ... in forward order within one run of the block on one rank: the odd-numbered
  ones are kept. Llama: wq (1) kept, wk (2) not, wv (3) kept, wo (4) not, w1 (5) kept, w3 (6) not,
  w2 (7) kept; GPT-2: fc1 (5) kept, fc2 (6) not. torch's math attention kernel adds two bmms after
  wv (4 and 5: the scores recomputed, the output kept), which leaves the projections' parity as is.
  MoE: the router (5) kept; dropless, expert e of the rank's experts runs w1, w3, w2 as matmuls
  6 + 3e to 8 + 3e, so even-numbered experts keep w3 and odd-numbered ones w1 and w2; with a
  capacity factor the batched w1, w3, w2 are 6 to 8 (w3 kept); then the shared experts' w1, w3, w2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig
from trainfit.models.block_spec import block_linears

OpKind = Literal["matmul", "fused_attention", "tp_reduction", "all_to_all", "other"]
"""The kinds of operator a policy tells apart (trainfit.recompute maps torch's operators to them)."""


@dataclass(frozen=True)
class CheckpointPolicy:
    """One memory.activation_checkpointing policy."""

    name: str
    wraps: bool
    """Whether the policy wraps blocks in a checkpoint at all (none: no)."""
    saves: frozenset[OpKind]
    """The kinds of operator whose outputs a wrapped block keeps beside its input."""
    every_other_matmul: bool = False
    """Of the matmuls, keep only the odd-numbered ones (1-based, forward order, per run of a block)."""

    def keeps(self, kind: OpKind, matmul_index: int = 0) -> bool:
        """Does a wrapped block keep the output of an operator of `kind` (a matmul: the
        `matmul_index`-th of the block's run, counted from 1)?"""
        if kind not in self.saves:
            return False
        return kind != "matmul" or not self.every_other_matmul or matmul_index % 2 == 1


_SELECTIVE_SAVES: frozenset[OpKind] = frozenset({"matmul", "fused_attention", "tp_reduction", "all_to_all"})
POLICIES: dict[str, CheckpointPolicy] = {
    "none": CheckpointPolicy("none", wraps=False, saves=frozenset()),
    "full": CheckpointPolicy("full", wraps=True, saves=frozenset()),
    "selective": CheckpointPolicy("selective", wraps=True, saves=_SELECTIVE_SAVES),
    "selective-alternate": CheckpointPolicy("selective-alternate", wraps=True, saves=_SELECTIVE_SAVES,
                                            every_other_matmul=True),
}
"""Every policy of config.ACPolicy, by name."""


def matmul_order(m: ModelConfig, local_experts: int, capacity: bool) -> list[tuple[str, int | None]]:
    """The matmuls one run of a block performs on a rank, in forward order: (linear name, routed
    expert index or None). Dropless, each of the rank's `local_experts` runs its w1, w3, w2 in turn;
    with a capacity factor one batched matmul per weight. The fused attention kernel is not a matmul."""
    order: list[tuple[str, int | None]] = []
    for linear in block_linears(m):
        if linear.routed and not capacity:
            continue
        order.append((linear.name, None))
        if linear.name == "router" and not capacity:  # the experts run after the router, one by one
            routed = [x.name for x in block_linears(m) if x.routed]
            order += [(name, e) for e in range(local_experts) for name in routed]
    return order


def kept_linear_shares(m: ModelConfig, policy: str, local_experts: int = 0, capacity: bool = False
                       ) -> dict[str, float]:
    """The share of each block linear's output a wrapped block keeps under `policy` (by
    models/block_spec.py name): 1 or 0, or for a dropless routed expert weight the share of the
    rank's experts that keep it (balanced routing: of their rows too)."""
    p = POLICIES[policy]
    local = local_experts or m.num_experts
    kept: dict[str, list[bool]] = {}
    for i, (name, _) in enumerate(matmul_order(m, local, capacity), start=1):
        kept.setdefault(name, []).append(p.keeps("matmul", i))
    return {name: sum(flags) / len(flags) for name, flags in kept.items()}


def shared_experts_first_matmul(local_experts: int, capacity: bool) -> int:
    """The 1-based position of the shared experts' w1 among an MoE block's matmuls on one rank (what
    selective-alternate's parity counts): wq, wk, wv, wo, the router, then the rank's routed experts'
    (w1, w3, w2 per expert, dropless; one batched matmul per weight with a capacity factor)."""
    return 9 if capacity else 6 + 3 * local_experts


def odd_expert_share(local_experts: int) -> float:
    """Dropless: the share of a rank's experts numbered 1, 3, 5, ... among the `local_experts` it runs
    (numbered from 0 on each rank): expert e's w1, w3, w2 are matmuls 6 + 3e to 8 + 3e, so
    selective-alternate keeps an odd-numbered expert's w1 and w2 outputs and an even-numbered one's w3."""
    return (local_experts // 2) / local_experts
