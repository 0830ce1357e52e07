"""Activations at a pipeline stage's ends: the final norm's (and what the output projection saves of it),
the residual stream crossing a stage boundary, what a zero-bubble schedule's input pass keeps per block
and head for the weight pass, and the step's token ids every pipeline rank holds. Torch-free."""

from __future__ import annotations

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    INDEX,
    ActDtypes,
    Terms,
    block_shapes,
    norm_input_bytes,
    norm_saved,
    ungated_mlp,
)
from trainfit.models.architecture import describe


def final_norm_terms(m: ModelConfig, d: ActDtypes, projected: bool = True) -> Terms:
    """The final norm: its input (the last block's output) and what the output projection saves of
    its output, and of soft-capped logits (Gemma 2, models/common.softcapped) the tanh's output, in the
    compute dtype (vocabulary-sharded under tp, like the logits). `projected` False: the chunked loss
    projects it (train/loss.py), and its output is the model's, which the loss holds
    (logits._chunked_loss)."""
    residual = norm_input_bytes(m, d) * m.dim
    norm = norm_saved(m, d, 1)
    if not projected:
        return Terms(seq=residual + norm.seq)
    capped = Terms(tp=d.compute * m.vocab_size) if describe(m).final_softcap else Terms()
    return Terms(seq=residual) + norm + capped


def stage_boundary_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """One micro-batch of the residual stream where a pipeline stage ends and the next begins: the
    stage's output, the next stage's input, and their gradients ([mb, T, D] in the stream's dtype;
    sequence-sharded under sequence parallelism, like the stream itself)."""
    return Terms(seq=d.stream * m.dim)


def weight_pass_pending_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """What a zero-bubble schedule's input-gradient pass keeps per block for the weight pass, beside
    the saved activations (torch/distributed/pipelining/_backward.py, stage_backward_input): a
    pre-hook on every node where a weight meets the input path (the matmuls' MmBackward0, the
    norms' MulBackward0 by their gain) stores its output's gradient in `param_group["grads"]`
    until stage_backward_weight. Per token: the gradient of each matmul's output (compute dtype;
    column-parallel ones on a tp rank: their 1/tp), of each norm's output and of the two residual
    sums the block's output matmuls feed (stream dtype). MoE: each of the token's routed and shared
    experts' two input matmuls and the router's logits instead of the dense MLP's."""
    D, q_dim, kv_dim, _, _ = block_shapes(m)
    c, a = d.compute, d.stream
    if m.num_experts:
        ffn = m.expert_ffn_dim or m.ffn_dim
        mlp = 2 * ffn * ((m.experts_per_token or 1) + (m.num_shared_experts or 0))
        return Terms(seq=a * 2 * D + c * 2 * D, gathered=c * (mlp + m.num_experts), tp=c * (q_dim + 2 * kv_dim))
    inputs = 1 if ungated_mlp(m) else 2  # GPT-2's fc; SwiGLU's w1 and w3
    return Terms(seq=a * 2 * D + c * 2 * D, tp=c * (q_dim + 2 * kv_dim + inputs * m.ffn_dim))


def head_weight_pass_pending_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """weight_pass_pending_terms of the last stage's head: the final norm's output gradient and the
    output projection's (the logits' gradient: a rank's vocabulary shard under tp)."""
    return Terms(seq=d.stream * m.dim, tp=d.compute * m.vocab_size)


def pipeline_batch_bytes(rows: int, seq_len: int, cp: int) -> int:
    """The step's token ids and targets (int64), which a pipeline step holds on every rank, the ranks
    between the ends too, from its first forward to its last backward (train/step.py's
    pipeline_forward_backward): each micro-batch's pair as the sampler gave it, [mb, T], and the pair of
    all `rows` concatenated, [rows, T] (context parallelism: the rank's [rows, T / cp] shard of it, the
    concatenation freed). Negligible beside a block's activations; most of what a rank of stages without
    blocks holds beside its pipeline buffers."""
    return 2 * INDEX * rows * (seq_len + seq_len // cp)
