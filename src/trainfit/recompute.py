"""Activation checkpointing: trade recomputation in backward for activation memory.

Policies (config: `memory.activation_checkpointing`, applied to every n-th transformer block):

- "none": every intermediate a block computes is kept for backward.
- "full": a block keeps only its input; backward reruns its forward first, up to one extra forward
  of the block's matmuls (+1/3 of its FLOPs). Non-reentrant checkpoint stops recomputing once every
  tensor backward needs is back, so a block's last matmul (whose output nothing saves) is skipped.
- "selective", "selective-alternate": op-level selective checkpointing (SAC). Which operators'
  outputs a wrapped block keeps is models/checkpoint_policy.py's description (the estimators read
  the same); this module maps torch's operators to its kinds (`op_kind`) and asks it per operator.
  selective keeps every matmul's output, so backward reruns no matmul, only elementwise ops, nearly
  free to rerun yet each keeping a full activation alive. selective-alternate (torchtitan's "op"
  policy) keeps every other matmul's: backward reruns about half of a block's matmuls (perf/flops.py
  counts which) and keeps about half of what "selective" keeps of them.

Blocks are wrapped with PyTorch's own `checkpoint_wrapper` (what torchtitan uses): its forward is
`torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False, ...)`, and it strips its
`_checkpoint_wrapped_module.` level from state_dict keys, a level torch.distributed (FSDP2, DCP's
get_state_dict) also knows to skip. So a wrapped model has exactly the keys of the plain one and
checkpoints move freely between policies. `model.named_parameters()` does still show the level.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy as TorchCheckpointPolicy
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from trainfit.config import ACPolicy, ConfigError
from trainfit.models.checkpoint_policy import POLICIES as POLICY_KEEPS
from trainfit.models.checkpoint_policy import CheckpointPolicy, OpKind
from trainfit.parallel.stage_split import checkpointed

_aten = torch.ops.aten

# torch's operators by the kind models/checkpoint_policy.py's policies keep or recompute. All are
# dispatch-level (post-autograd) aten ops: `F.linear` never appears itself, it reaches the
# dispatcher as mm/addmm (plus views). Any other operator is of kind "other" (recomputed).
_MATMULS = frozenset({
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_mm.default,  # fp8 matmuls (torchao float8)
    _aten._scaled_mm_v2.default,
})
_FUSED_ATTENTION = frozenset({
    # Fused SDPA kernels (F.scaled_dot_product_attention picks one per device and inputs); their
    # outputs include the logsumexp the backward needs, so nothing inside attention is recomputed.
    # The math fallback decomposes into bmm (matmuls) and softmax.
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
})
# Tensor parallelism's reductions of row-parallel outputs (reduce-scatter with sequence parallelism,
# all-reduce without). All-gathers (sequence parallelism's inputs, context parallelism's K/V) are
# of kind "other".
_TP_REDUCTIONS = frozenset({
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
})
# Expert parallelism's all-to-alls (the split sizes' exchange, the dispatch and the combine).
_ALL_TO_ALL = frozenset({torch.ops._c10d_functional.all_to_all_single.default})

POLICIES: tuple[str, ...] = typing.get_args(ACPolicy)


def op_kind(op: Any) -> OpKind:
    """The kind of a dispatched torch operator, in models/checkpoint_policy.py's terms."""
    if op in _MATMULS:
        return "matmul"
    if op in _FUSED_ATTENTION:
        return "fused_attention"
    if op in _TP_REDUCTIONS:
        return "tp_reduction"
    return "all_to_all" if op in _ALL_TO_ALL else "other"


def _policy_contexts(policy: CheckpointPolicy) -> tuple[Any, Any]:
    """The selective-checkpointing contexts of one run of one block (context_fn is called per
    checkpointed call): each operator kept or recomputed as `policy` says. The forward and the
    recompute count their matmuls apart, so both pick the same ones."""
    matmuls = {False: 0, True: 0}  # by ctx.is_recompute

    def decide(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> TorchCheckpointPolicy:
        kind = op_kind(op)
        if kind == "matmul":
            matmuls[ctx.is_recompute] += 1
        keep = policy.keeps(kind, matmuls[ctx.is_recompute])
        return TorchCheckpointPolicy.MUST_SAVE if keep else TorchCheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(decide)


def apply_activation_checkpointing(model: nn.Module, policy: str, every_n_layers: int = 1) -> int:
    """Wrap blocks of `model.layers` in place; returns how many were wrapped.

    With `every_n_layers=n` the blocks i with i % n == 0 are wrapped (n=1: all; n=2: the 1st, 3rd,
    ...). Starting from the first block leaves the last one unwrapped when n > 1: backward begins
    there, at the step's memory peak, and an unwrapped block needs no recompute, so the peak does
    not grow by a recomputed block's activations.
    """
    if policy not in POLICIES:
        raise ConfigError(f"memory.activation_checkpointing={policy!r}: choose one of "
                          + " | ".join(POLICIES))
    if every_n_layers < 1:
        raise ConfigError(f"memory.ac_every_n_layers={every_n_layers!r}: must be >= 1")
    if policy == "none":
        return 0
    # Non-reentrant checkpoint: supports kwargs, autograd.grad and inputs that need no grad. A policy
    # that keeps outputs inside the block runs under selective checkpointing; full keeps none.
    keeps = POLICY_KEEPS[policy]
    options: dict[str, Any] = {"context_fn": functools.partial(_policy_contexts, keeps)} if keeps.saves else {}
    wrapped = 0
    for i, block in model.layers.indexed():  # global indices: a pipeline stage holds some of them
        if checkpointed(i, every_n_layers):
            model.layers[i] = checkpoint_wrapper(block, **options)
            wrapped += 1
    return wrapped
