"""What one block's backward creates beyond its saved activations, moment by moment (`Transient`): the
stream's incoming gradient and its cast, the attention's and the MLP's gradients, a checkpointed block's
recompute tail, the routed experts' gradients; what the block has freed by its attention's backward; and
what it holds at the backward of each branch's first linears (`FirstLinears`). memory/closed_form/step_peak.py
combines them with the saved tensors into the backward's moments. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    ActDtypes,
    Terms,
    Transient,
    block_shapes,
    ffn_consumers,
    layer_of,
    norm_input_bytes,
    norm_saved,
    sandwich_post_norms_saved,
    swiglu_saved,
    ungated_mlp,
)
from trainfit.memory.closed_form.block.activations import policy_keeps_shared_output
from trainfit.memory.closed_form.block.attention_activations import attention_backward
from trainfit.memory.closed_form.block.moe_activations import Routing, balanced_routing, moe_saved


@dataclass(frozen=True)
class FirstLinears:
    """A branch's backward at its first linears (those reading the branch's normed input: the
    attention's wq, wk, wv; the MLP's w1 and w3, or fc1), at the last of them to run: autograd runs the
    node made later first, so wv, wk, then wq; w3, then w1. Everything of the branch beyond them has
    run backward and freed what it saved."""

    kept: Terms
    """What the block still saves then (unwrapped), of the tensors block_terms counts: at wq, its input
    (RMSNorm: the fp32 copy; LayerNorm: the input), the attention norm's own tensors and its output as
    wq saves it (under autocast wq's own cast; wk's and wv's are freed)."""
    block_input: Terms
    """What a checkpointed block keeps of its own then: its input (every policy keeps it; what else a
    policy kept, the attention's and the MLP's outputs, its recompute consumed or the backward freed)..."""
    rebuilt: Terms
    """...and what its recompute rebuilt, of `kept`: all but the block input (RMSNorm's fp32 copy of a
    16-bit input is rebuilt too)."""
    freed: Terms
    """At w1 (fc1), what the block has freed instead, the rest being kept: the MLP's saved tensors
    (SwiGLU's four, GELU's two) and, under autocast, w3's cast of its input. An MoE's experts run
    their own backwards (moe_activations.routed_backward_moments): none."""
    attention_new: Terms
    """At the end of wq's backward: its output gradient (q's, after RoPE's backward), the partial
    sum of the attention norm output's gradient (autograd keeps one buffer per input, into which wv's
    and wk's input gradients are summed: the norm output's dtype, the stream's, as autocast's cast's
    backward converts to it) and wq's own input gradient (the matmul's dtype). Under tensor parallelism
    each is the rank's whole-width partial sum (gathered)."""
    mlp_new: Terms
    """The same at w1's (SwiGLU: w1's output gradient, silu's backward, and w3's input gradient
    as the partial sum) or fc1's (GELU's gradient; fc1 is its input's only consumer: no sum)."""


def first_linears(m: ModelConfig, d: ActDtypes) -> FirstLinears:
    """What a block holds at the backward of its branches' first linears (FirstLinears)."""
    D, q_dim, _, _, _ = block_shapes(m)
    c = d.compute
    residual = norm_input_bytes(m, d) * D
    rebuilt = norm_saved(m, d, 1) + Terms(seq=0 if residual == d.stream * D else residual)
    kept = Terms(seq=residual) + norm_saved(m, d, 1)
    input_grad = Terms(gathered=c * D)
    attention_new = Terms(tp=c * q_dim, gathered=d.stream * D) + input_grad
    at_attention = dict(kept=kept, block_input=Terms(seq=d.stream * D), rebuilt=rebuilt, attention_new=attention_new)
    if m.num_experts:
        return FirstLinears(**at_attention, freed=Terms(), mlp_new=Terms())
    if ungated_mlp(m):
        return FirstLinears(**at_attention, freed=Terms(tp=2 * c * m.ffn_dim),
                            mlp_new=Terms(tp=c * m.ffn_dim) + input_grad)
    w3_cast = Terms(gathered=c * D if d.autocast else 0)
    return FirstLinears(**at_attention, freed=Terms(tp=swiglu_saved(c, m.ffn_dim)) + w3_cast,
                        mlp_new=Terms(tp=c * m.ffn_dim, gathered=d.stream * D) + input_grad)


def attention_backward_freed(m: ModelConfig, d: ActDtypes, routing: Routing | None = None) -> Terms:
    """What a block has freed of what it saved (or its recompute rebuilt) when its attention's backward
    runs, after its feed-forward's and output projection's: the MLP's tensors (an MoE block's: the router's
    and every expert's, `routing`'s rows), its norm's, the mid-block residual the norm saved, and the output
    projection's input."""
    _, q_dim, _, _, _ = block_shapes(m)
    c = d.compute
    residual = norm_input_bytes(m, d) * m.dim
    if m.num_experts:
        ffn = moe_saved(m, d, routing or balanced_routing(m))
    else:
        ffn = Terms(tp=2 * c * m.ffn_dim if ungated_mlp(m) else swiglu_saved(c, m.ffn_dim))
    after = sandwich_post_norms_saved(m, d) if layer_of(m).norm_placement == "sandwich" else Terms()
    return Terms(seq=residual, tp=c * q_dim) + ffn + norm_saved(m, d, ffn_consumers(m)) + after


def backward_transient_terms(m: ModelConfig, d: ActDtypes, routing: Routing | None = None,
                             sequence_parallel: bool = False, policy: str = "none", cp: int = 1) -> Transient:
    """Bytes while one block runs its backward, beyond its saved activations (measured on CPU):
    the MLP's intermediate gradients (SwiGLU: the gradients of the w2 input, of silu out and of
    w3 out, 3 F, once the w2 input is freed; GELU MLP: the gradients of the GELU output and input,
    2 F, once the GELU output is freed) or the attention's gradients, plus the stream's gradient.
    MoE: the largest of the shared experts' SwiGLU and the largest single routed computation
    (`Routing.busiest`: the busiest dropless expert, or all capacity buffers at once); the experts'
    backwards run one at a time, so only the largest one's gradients exist at once."""
    D, q_dim, kv_dim, _, _ = block_shapes(m)
    c = d.compute
    # Under autocast the residual add (fp32 + bf16 branch) also casts the gradient for the branch.
    grad_cast = Terms(seq=c * D if d.autocast else 0)
    # The MLP's input held by its forward: saved itself (so rebuilt) unless autocast saves its casts.
    tail = Terms(seq=d.stream * D, gathered=d.stream * D if sequence_parallel else 0) if d.autocast else Terms()
    expert = {}
    if ungated_mlp(m):
        # fp32/16-bit: GELU's backward (its input's and output's gradients, fc2's input freed);
        # autocast: inside fc2's backward (its input's gradient, before the fp32 cast-back).
        hidden, grads = m.ffn_dim, 1 if d.autocast else 2
    elif m.num_experts:
        # mlp_*: the shared experts' SwiGLU, whose backward runs first; expert_*: the routed ones'.
        F, busiest = m.expert_ffn_dim, (routing or balanced_routing(m)).busiest
        hidden, grads = m.num_shared_experts * F, 3
        # The routed output; with shared experts their sum, and their output unless the policy kept it.
        shared_output = 0 if policy_keeps_shared_output(m, routing or balanced_routing(m), policy) else c * D
        tail += Terms(gathered=d.stream * D + (d.stream * D + shared_output if m.num_shared_experts else 0))
        expert = dict(expert_output=Terms(gathered=3 * d.stream * D * busiest),
                      expert_output_freed=Terms(gathered=d.stream * D * busiest),
                      expert_hidden=Terms(gathered=2 * c * F * busiest),
                      expert_accumulation=Terms(gathered=c * F * busiest),
                      expert_input_grad=Terms(gathered=d.stream * D))
    else:
        hidden, grads = m.ffn_dim, 3
    split = "gathered" if m.num_experts else "tp"  # an MoE's shared experts are whole on the tp ranks
    # An MoE's output is in the stream's dtype (its fp32 routing weights promote it): no cast.
    branch_bytes = d.stream if m.num_experts else c
    branch_grad = Terms(gathered=branch_bytes * D) if sequence_parallel else Terms() if m.num_experts else grad_cast
    return Transient(grad_stream=Terms(seq=d.stream * D), grad_cast=grad_cast, branch_grad=branch_grad,
                     attention=attention_backward(m, d, cp), mlp_new=Terms(**{split: grads * c * hidden}),
                     mlp_freed=Terms(**{split: c * hidden if grads > 1 else 0}), recompute_tail=tail, **expert)
