"""Attention written out op by op, for what no fused kernel here takes: soft-capped scores (Gemma 2, where
FlexAttention has no backward) and attention sinks (gpt-oss: a learned logit per query head that joins each
query's softmax as a key without a value). In transformers' order, so that its logits match; the
estimators price what each op keeps (memory/closed_form/block/attention_activations.py)."""

from __future__ import annotations

import torch


def causal_mask(T: int, like: torch.Tensor) -> torch.Tensor:
    """An additive causal mask [T, T] (0 or -inf) of this call's: nothing keeps it."""
    return torch.zeros(T, T, dtype=like.dtype, device=like.device).masked_fill_(
        torch.ones(T, T, dtype=torch.bool, device=like.device).triu_(1), float("-inf"))


def eager_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                    window_TT: torch.Tensor | None, scale: float | None, softcap: float = 0.0,
                    sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention (within `window_TT` when given: common.window_mask's). It keeps q, the keys and values
    expanded to the query heads, with `softcap` the tanh's output [heads, queries, keys], the fp32
    probabilities (with `sinks_H` over keys + 1: the sink's column is dropped after the softmax) and their
    cast to the queries' dtype."""
    H, G, T = q_BHTK.shape[1], k_BGTK.shape[1], q_BHTK.shape[2]
    if G != H:
        k_BGTK, v_BGTK = k_BGTK.repeat_interleave(H // G, dim=1), v_BGTK.repeat_interleave(H // G, dim=1)
    scores_BHTS = torch.matmul(q_BHTK, k_BGTK.transpose(2, 3)) * (scale or q_BHTK.shape[-1] ** -0.5)
    if softcap:
        scores_BHTS = torch.tanh(scores_BHTS / softcap) * softcap
    scores_BHTS = scores_BHTS + (causal_mask(T, scores_BHTS) if window_TT is None else window_TT)
    if sinks_H is None:
        probs_BHTS = torch.softmax(scores_BHTS, dim=-1, dtype=torch.float32)
    else:
        B, S = scores_BHTS.shape[0], scores_BHTS.shape[-1]
        sink_BHT1 = sinks_H.to(scores_BHTS.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        probs_BHTS = torch.softmax(torch.cat([scores_BHTS, sink_BHT1], dim=-1), dim=-1, dtype=torch.float32)[..., :S]
    return torch.matmul(probs_BHTS.to(q_BHTK.dtype), v_BGTK)
