"""One micro-batch's activation sizes on a rank (`MicroBatch`): a block's saved, rebuilt and backward tensors,
the head's, the loss's and a stage boundary's, from the terms of block/activations.py and its siblings. They
depend only on the model, the dtypes and the micro-batch's shape, so `SharedSizes` computes each once for all
the layouts the planner tries of one model. Torch-free."""

from __future__ import annotations

from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import Terms, Transient, scores_kept
from trainfit.memory.closed_form.block.activations import block_terms, policy_only_terms, regathered_terms
from trainfit.memory.closed_form.block.adapter_activations import (
    adapter_terms,
    final_norm_adapter_terms,
    selective_adapter_terms,
)
from trainfit.memory.closed_form.block.attention_activations import (
    context_parallel_positions,
    packed_mask_bytes,
    packed_positions,
)
from trainfit.memory.closed_form.block.backward_transients import (
    attention_backward_freed,
    backward_transient_terms,
    first_linears,
)
from trainfit.memory.closed_form.block.moe_activations import Routing, moe_routing
from trainfit.memory.closed_form.block.te_layer import te_layer_terms
from trainfit.memory.closed_form.logits import LossBytes, loss_bytes, megatron_loss_bytes
from trainfit.memory.closed_form.run_shape import MicroBatchShape, Precision
from trainfit.memory.closed_form.stage_activations import (
    final_norm_terms,
    head_weight_pass_pending_terms,
    stage_boundary_terms,
    weight_pass_pending_terms,
)
from trainfit.models.architecture import layer_kinds
from trainfit.models.params import param_counts


class MicroBatch(NamedTuple):
    """One micro-batch's activation bytes that every pipeline rank of a layout has alike: a block's
    (saved, rebuilt by its recompute, made by its backward: backward_transients.Transient's sizes), the
    head's and the loss's (on the rank of the last stage), a stage boundary's."""

    routing: Routing | None
    transient: Transient
    none: int
    """A block's saved activations without checkpointing..."""
    policy: int
    """...and under the checkpointing policy (the blocks it wraps)."""
    positions: int
    """What the blocks share and save of a micro-batch: the RoPE rows of its positions (context parallelism,
    packed rows) and packed rows' document masks..."""
    forward_masks: int
    """...except under the eager soft-capped attention, which adds a mask to its scores and keeps nothing of it:
    packed rows' masks then live through the model's forward only (models/llama.Transformer.forward)."""
    final: int
    loss: LossBytes
    rebuild: int
    """What a checkpointed block recomputes in backward."""
    released: int
    """Saved by the policy, freed by the recompute."""
    released_last: int
    grad_stream: int
    grad_cast: int
    branch_grad: int
    attention: int
    mlp_new: int
    mlp_freed: int
    recompute_tail: int
    attention_freed: int
    """The math attention kernel's: what its backward finds freed (attention_backward_freed)."""
    first_kept: int
    """At the attention's first linears' backward: what the block still saves (FirstLinears.kept)..."""
    first_input: int
    """...of which a checkpointed block keeps its input (FirstLinears.block_input)...."""
    first_rebuilt: int
    """...and its recompute rebuilt the rest (FirstLinears.rebuilt)..."""
    first_attention_new: int
    """...and what the backward holds of its own there (FirstLinears.attention_new)."""
    first_mlp_freed: int
    """At the MLP's first linears' backward: what the block has freed (FirstLinears.freed)..."""
    first_mlp_new: int
    """...and what the backward holds of its own there (FirstLinears.mlp_new)."""
    boundary: int
    weight_pending: int
    head_weight_pending: int


def _micro_batch(m: ModelConfig, prec: Precision, shape: MicroBatchShape) -> MicroBatch:
    act, policy, tp, cp = prec.act, shape.policy, shape.tp, shape.cp

    def size(terms: Terms) -> int:
        return terms.bytes(shape.tokens, shape.seq, tp, shape.sequence_parallel)

    routing = moe_routing(m, shape.tokens, shape.moe_imbalance, shape.ep)
    # another engine's layers (block/te_layer.py) where they describe this one, without adapters
    other = te_layer_terms(m, shape.fp8_linears) if shape.layers == "transformer_engine" and \
        not shape.adaptation else None
    none = size(other) if other is not None else \
        size(block_terms(m, act, "none", routing, cp, tp)
             + (adapter_terms(m, act, shape.adaptation, routing) if shape.adaptation else Terms())
             + (regathered_terms(m, act) if shape.regathers else Terms()))
    wrapped = size(block_terms(m, act, policy, routing, cp, tp)
                   + (selective_adapter_terms(m, act, shape.adaptation, routing)
                      if shape.adaptation and policy.startswith("selective") else Terms())) \
        if policy != "none" else none
    t = backward_transient_terms(m, act, routing, shape.sequence_parallel, policy, cp)
    only = policy_only_terms(m, act, policy, tp, routing, cp)
    released = size(only.released)
    first = first_linears(m, act)
    masks = packed_mask_bytes(m, shape.tokens // shape.seq, shape.seq, act.compute, shape.document_mask_kernel) \
        if shape.document_mask_kernel else 0
    return MicroBatch(
        routing=routing, transient=t, none=none, policy=wrapped,
        positions=size(context_parallel_positions(m, cp, shape.rope_table_bytes) + packed_positions(m, act))
        + (0 if act.eager_attention else masks), forward_masks=masks if act.eager_attention else 0,
        final=size(final_norm_terms(m, act, projected=not shape.chunked_loss)
                   + (final_norm_adapter_terms(m, act, shape.adaptation, not shape.chunked_loss)
                      if shape.adaptation else Terms())),
        loss=megatron_loss_bytes(m, prec, shape) if other is not None and not shape.chunked_loss
        else loss_bytes(m, prec, shape),
        rebuild=none - wrapped + released + size(only.kept), released=released,
        released_last=size(only.released_last), grad_stream=size(t.grad_stream), grad_cast=size(t.grad_cast),
        branch_grad=size(t.branch_grad), attention=size(t.attention), mlp_new=size(t.mlp_new),
        mlp_freed=size(t.mlp_freed), recompute_tail=size(t.recompute_tail),
        attention_freed=size(attention_backward_freed(m, act, routing)) if scores_kept(m, act) else 0,
        first_kept=size(first.kept), first_input=size(first.block_input),
        first_rebuilt=size(first.rebuilt), first_attention_new=size(first.attention_new),
        first_mlp_freed=size(first.freed), first_mlp_new=size(first.mlp_new),
        boundary=size(stage_boundary_terms(m, act)), weight_pending=size(weight_pass_pending_terms(m, act)),
        head_weight_pending=size(head_weight_pass_pending_terms(m, act)))


class SharedSizes:
    """What the memory estimates of one model's layouts share: its parameter counts, and a
    micro-batch's activation sizes by dtypes and shape (MicroBatchShape), each computed once. The planner's
    thousands of layouts have a few hundred shapes; pass one SharedSizes to the StageMemory of
    each (of this model only)."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.counts = param_counts(model)
        self._micro_batches: dict[tuple[Precision, MicroBatchShape], MicroBatch] = {}
        kinds = layer_kinds(model)
        self._kinds = tuple(SharedSizes(k) for k in kinds) if len(kinds) > 1 else None

    @property
    def kinds(self) -> tuple[SharedSizes, ...]:
        """Each kind of layer's (architecture.layer_kinds): the model's own where its layers are alike (made
        on each call: a tuple of itself kept would be a reference cycle, which the planner must not leave)."""
        return self._kinds or (self,)

    def micro_batch(self, prec: Precision, shape: MicroBatchShape) -> MicroBatch:
        found = self._micro_batches.get((prec, shape))  # one lookup: the key's dataclasses hash in Python
        if found is None:
            found = self._micro_batches[prec, shape] = _micro_batch(self.model, prec, shape)
        return found
