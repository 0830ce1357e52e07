"""The language-model loss of a micro-batch: mean next-token cross-entropy in fp32, from the model's
logits, or under memory.chunked_loss from its final hidden states, projected and scored a chunk of
tokens at a time so that the [tokens, vocabulary] logits never exist whole.

The chunked form runs each chunk (output projection, fp32 cast, cross-entropy summed over its
tokens) under non-reentrant activation checkpointing: the forward keeps nothing of a chunk but its
inputs (the hidden rows, already alive, and the weight), and the backward recomputes one chunk's
logits at a time. Its peak is one chunk's logits and their gradients instead of the whole micro-
batch's (memory/closed_form/logits.py's loss_bytes prices both). Liger-Kernel's fused linear cross-entropy does
the same in one Triton kernel on GPUs; it is not used: it cannot run here (no Triton on CPU), and
it takes plain tensors, where tensor parallelism's vocabulary-sharded weight is a DTensor whose
cross-entropy torch's loss_parallel computes without gathering the vocabulary.

Under tensor parallelism the output weight is a DTensor sharded over the vocabulary (Shard(0)); the
hidden states become one replicated DTensor first (all-gathered along the sequence under sequence
parallelism; their gradient is reduced in backward), exactly what the output projection's
ColwiseParallel does to its input, and each chunk's logits stay sharded into loss_parallel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from trainfit.models.common import softcapped
from trainfit.sample_rows import scored_rows

IGNORE = -100
"""A target the loss leaves out (a fine-tuning prompt's, padding's: train/samples.py); torch's ignore_index."""


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Mean cross-entropy of [B, T, V] logits (or [N, V]) against their targets, in fp32. `masked`
    (fine-tuning samples): over the targets that are not IGNORE, 0 where every one is (a rank's shard of a
    prompt); text's targets are all trained, and its plain mean launches fewer kernels."""
    # Not .float() on fp32 logits: on a DTensor (vocabulary-parallel logits) that copies the
    # logits shard instead of returning it.
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if not masked:
        return _local(F.cross_entropy(logits.flatten(0, -2), targets.flatten()))
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    return _local(loss) / _trained(targets)


def _trained(targets: torch.Tensor) -> torch.Tensor:
    """The targets a mean divides by: those not IGNORE, at least 1."""
    return (targets != IGNORE).sum().clamp(min=1)


def chunked_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, *, output: nn.Linear,
                          chunk_tokens: int, softcap: float = 0.0, masked: bool = False,
                          traced_share: float = 1.0) -> torch.Tensor:
    """cross_entropy(output(hidden), targets) without the whole logits: `hidden` [B, T, D] (the final
    norm's output), projected by `output`'s weight `chunk_tokens` tokens at a time. Call it inside
    the forward's autocast region (if any): each chunk projects as the model's own forward would, and
    checkpointing re-enters that autocast state when it recomputes the chunk in backward. `softcap`: the
    model's soft-capped logits (models/common.softcapped), applied to each chunk's. `traced_share`: under
    fake tensors, the share of rows taken to train (_trained_rows)."""
    if output.bias is not None:
        raise ValueError("chunked_cross_entropy: the output projection has a bias; no model of trainfit's has one")
    weight = output.weight
    if isinstance(weight, DTensor):  # vocabulary-parallel output (module docstring)
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(placements=[Replicate()])
        else:
            hidden = DTensor.from_local(hidden, weight.device_mesh, [Replicate()], run_check=False)
    rows, labels = hidden.flatten(0, 1), targets.flatten()
    if masked:
        rows, labels = _trained_rows(rows, labels, chunk_tokens, traced_share)
    total = None
    for start in range(0, rows.shape[0], chunk_tokens):
        chunk = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss_sum, rows[chunk], weight, labels[chunk], softcap, use_reentrant=False)
        else:
            part = _chunk_loss_sum(rows[chunk], weight, labels[chunk], softcap)
        total = part if total is None else total + part
    assert total is not None, "an empty micro-batch"
    return _local(total) / (_trained(labels) if masked else labels.numel())


def _trained_rows(rows: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, traced_share: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows whose target trains, and their targets: a prompt's rows are neither projected nor scored (a
    long prompt costs no logits). Their count is rounded up to whole chunks (scored_rows; the extra rows
    score nothing), so that the chunks keep one shape from step to step and the allocator reuses their
    blocks. Vocabulary-parallel rows arrive replicated (sequence parallelism's gathered). Under fake tensors
    (the traced estimate) which rows train is data: the first `traced_share` of them stand for them (what
    the samples' statistics say: sample_rows.SampleRows.scored_share)."""
    if isinstance(rows, DTensor):  # replicated (chunked_cross_entropy): each rank selects the same rows
        local, labels = _trained_rows(rows.to_local(), labels, chunk_tokens, traced_share)
        return DTensor.from_local(local, rows.device_mesh, [Replicate()], run_check=False), labels
    total = labels.shape[0]
    if is_fake(labels):
        kept = scored_rows(math.ceil(total * traced_share), total, chunk_tokens)
        return rows[:kept].clone(), labels[:kept]
    trained = labels != IGNORE
    kept = scored_rows(int(trained.sum()), total, chunk_tokens)
    keep = torch.argsort((~trained).to(torch.uint8), stable=True)[:kept]  # the trained rows first, in order
    return rows.index_select(0, keep), labels.index_select(0, keep)


def _chunk_loss_sum(rows: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float) -> torch.Tensor:
    """Summed fp32 cross-entropy of one chunk of rows."""
    logits = softcapped(F.linear(rows, weight), softcap)
    logits = logits if logits.dtype == torch.float32 else logits.float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


def loss_function(chunk_tokens: int, output: Callable[[], nn.Linear | None], softcap: float = 0.0,
                  masked: bool = False, traced_share: float = 1.0
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a model's output and its targets: `cross_entropy` of logits, or with
    `chunk_tokens` > 0 (memory.chunked_loss) `chunked_cross_entropy` of the final hidden states by
    the weight of `output()` (looked up at each call: it is FSDP's unsharded one during the step).
    `masked`: targets may be IGNORE (fine-tuning samples)."""
    if not chunk_tokens:
        return functools.partial(cross_entropy, masked=masked) if masked else cross_entropy

    def chunked(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        head = output()
        assert head is not None, "the chunked loss runs where the output projection lives"
        return chunked_cross_entropy(hidden, targets, output=head, chunk_tokens=chunk_tokens, softcap=softcap,
                                     masked=masked, traced_share=traced_share)

    return chunked


def _local(loss: torch.Tensor) -> torch.Tensor:
    """Vocabulary-parallel logits give a loss replicated on the tp ranks: its local value."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
