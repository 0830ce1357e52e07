"""The loss region's memory on the last pipeline stage (the `logits` component): train/loss.py's
cross-entropy over the whole logits, torch's loss_parallel under tensor parallelism, or the chunked loss
(memory.chunked_loss). Apart from the blocks' activations because its terms scale with the vocabulary, not
the model width. Torch-free."""

from __future__ import annotations

import math
from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import FP32, Terms
from trainfit.memory.closed_form.block.te_layer import megatron_loss_saved
from trainfit.memory.closed_form.run_shape import MicroBatchShape, Precision
from trainfit.sample_rows import scored_rows

LOSS_PARALLEL_FP32_COPIES = (2, 4)
"""Under tp the logits stay sharded over the vocabulary into torch's loss_parallel (a rank holds
ceil(V / tp) columns), whose log-softmax and its backward are written out op by op
(torch/distributed/tensor/parallel/loss.py), not fused: inside the forward loss the shifted
logits and their exp exist beside the logits (2 fp32 shards where the fused kernel has 1); the
backward of nll + log-softmax holds the saved log-probabilities, the zeros-then-scatter gradient,
exp(log-probabilities) and their sum (4 fp32 shards where the fused backward has 3)."""


class LossBytes(NamedTuple):
    """The loss region's bytes on the last stage (the logits component)."""

    saved: int
    """What the loss saves for its backward beside the model's output (the log-probabilities;
    chunked: sequence parallelism's all-gathered hidden states)."""
    output: int
    """The model's output: the logits, or under memory.chunked_loss the final hidden states."""
    forward: int
    """Peak inside the loss's forward, the output included."""
    backward: int
    """Peak at the loss's backward, without the output."""
    keeps_output: bool = False
    """The loss holds the output through its backward (the chunked loss's checkpoint inputs)."""


def loss_bytes(m: ModelConfig, prec: Precision, shape: MicroBatchShape) -> LossBytes:
    """train/loss.py's loss of one micro-batch of `tokens` tokens: logits (compute dtype) ->
    .float() (a copy unless fp32 already) -> cross_entropy = log_softmax (fp32, saved) + nll_loss.
    Backward starts with nll_loss's gradient (fp32) and log_softmax's input gradient while its
    output is still held: 3 fp32 logits (measured). Under tp, loss_parallel's unfused forms
    (LOSS_PARALLEL_FP32_COPIES) on a rank's vocabulary shard. Chunked: `_chunked_loss`. (Soft-capped
    logits: the model's forward saves their tanh's output, stage_activations.final_norm_terms.)"""
    tokens, tp = shape.tokens, shape.tp
    V = -(-m.vocab_size // tp)  # the largest shard: an uneven vocabulary's first ranks
    c = prec.act.compute
    copy = FP32 if c != FP32 else 0
    inside, backward = LOSS_PARALLEL_FP32_COPIES if tp > 1 else (1, 3)
    if shape.chunked_loss:
        return _chunked_loss(m, prec, shape, V, inside, backward, c if m.final_softcap else 0)
    return LossBytes(saved=FP32 * V * tokens, output=c * V * tokens, forward=V * tokens * (c + copy + inside * FP32),
                     backward=backward * FP32 * V * tokens)


def megatron_loss_bytes(m: ModelConfig, prec: Precision, shape: MicroBatchShape) -> LossBytes:
    """Megatron-Core's vocabulary-parallel cross entropy (block/te_layer.py): an fp32 copy of the logits,
    the softmax in place, a mask and a target per token, saved; the logits in the compute dtype live to the
    forward's end; its backward makes the fp32 gradient in the saved softmax's place and casts it for the
    head (the compute dtype's copy beside it)."""
    tokens, c = shape.tokens, prec.act.compute
    V = -(-m.vocab_size // shape.tp)
    return LossBytes(saved=megatron_loss_saved(V) * tokens, output=c * V * tokens,
                     forward=(c + FP32) * V * tokens, backward=(FP32 + c) * V * tokens)


def _chunked_loss(m: ModelConfig, prec: Precision, shape: MicroBatchShape, V: int, inside: int,
                  backward: int, capped: int) -> LossBytes:
    """memory.chunked_loss (train/loss.py): the model returns the final norm's output [tokens, D] in
    the stream's dtype, which the loss's checkpointed chunks keep as their inputs through its
    backward (under sequence parallelism its all-gathered, whole-sequence copy too). A chunk of q
    tokens then holds, in forward, its fp32 logits (the 16-bit ones are cast and dropped: nothing
    saves them) and log-softmax, and under tp loss_parallel's extra fp32 forms; in backward, the
    recomputed log-softmax and the two gradients (4 under tp), and under autocast the chunk's rows
    cast to the compute dtype, which the recomputed projection saves for its weight gradient. From
    the second chunk on, autograd also sums the chunks' gradients in its input buffers before
    passing them on: the output weight's (the matmul's dtype, one vocabulary shard) and the hidden
    states' (whole tokens: each chunk's slice gradient is full-size). Soft-capped logits: a chunk's tanh
    output (`capped` bytes per element) beside them, in forward and in its recompute."""
    D, act, tokens = m.dim, prec.act, shape.tokens
    sequence_parallel = shape.sequence_parallel
    # fine-tuning samples: only the rows whose target trains are kept (a copy, the whole output freed) and
    # projected (train/loss.py's _trained_rows)
    scored = tokens if shape.scored_share >= 1 else \
        scored_rows(math.ceil(tokens * shape.scored_share), tokens, shape.loss_chunk_tokens)
    output = Terms(seq=act.stream * D).bytes(tokens, 0, shape.tp, sequence_parallel) if scored == tokens else \
        act.stream * D * scored
    gathered = act.stream * D * tokens if sequence_parallel and shape.tp > 1 else 0
    chunk = min(scored, shape.loss_chunk_tokens)
    sums = V * D * act.compute + scored * D * act.stream if scored > chunk else 0
    rows_cast = act.compute * D * chunk if act.autocast else 0
    return LossBytes(saved=gathered, output=output,
                     forward=output + gathered + ((1 + inside) * FP32 + capped) * V * chunk,
                     backward=gathered + (backward * FP32 + capped) * V * chunk + sums + rows_cast, keeps_output=True)
