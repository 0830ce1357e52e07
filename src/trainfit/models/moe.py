"""Routed-experts feed-forward (Mixtral style) with optional shared experts.

Names: `router` (Linear dim -> num_experts, no bias), `experts.{w1,w2,w3}` stacked [E, F, D] /
[E, D, F] / [E, F, D] (w1 gate, w3 up, w2 down, as in torchtitan's GroupedExperts, so expert
parallelism can shard dim 0), `shared_experts.{w1,w2,w3}` (one SwiGLU of width
num_shared_experts * expert_ffn_dim, which equals the sum of that many experts of width expert_ffn_dim).

Routing matches transformers' Mixtral: softmax over all experts in fp32, top-k, renormalize the k
weights (the same as a softmax over the top-k logits).

Shape suffixes: B batch, T sequence, N tokens (B*T), D model dim, E experts, K experts per token,
F expert hidden, M tokens routed to one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainfit.config.schema import ModelConfig
from trainfit.models.common import FeedForward


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs stored as stacked weights."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
        """Each expert runs on exactly the tokens routed to it; index_add_ is deterministic on CPU."""
        out_ND = torch.zeros_like(x_ND)
        for e in range(self.w1.shape[0]):
            token_M, slot_M = torch.nonzero(expert_NK == e, as_tuple=True)
            x_MD = x_ND.index_select(0, token_M)
            h_MF = F.silu(F.linear(x_MD, self.w1[e])) * F.linear(x_MD, self.w3[e])
            y_MD = F.linear(h_MF, self.w2[e]) * weight_NK[token_M, slot_M, None].to(x_ND.dtype)
            out_ND.index_add_(0, token_M, y_MD)
        return out_ND


class MoE(nn.Module):
    """Top-k routed experts plus shared experts. After each forward, `aux_loss` holds this layer's
    Switch-Transformer load-balancing loss E * sum_i f_i * P_i, where f_i is the fraction of
    tokens routed to expert i (each token counts once per chosen expert, so the f_i sum to K and a
    perfectly balanced router scores K, as in transformers' Mixtral) and P_i the mean router
    probability of expert i."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.experts_per_token
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim)
        shared_dim = cfg.num_shared_experts * cfg.expert_ffn_dim
        self.shared_experts = FeedForward(cfg.dim, shared_dim) if shared_dim else None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        probs_NE = F.softmax(self.router(x_ND).float(), dim=-1)
        weight_NK, expert_NK = probs_NE.topk(self.top_k, dim=-1)
        weight_NK = weight_NK / weight_NK.sum(dim=-1, keepdim=True)
        out_ND = self.experts(x_ND, expert_NK, weight_NK)
        if self.shared_experts is not None:
            out_ND = out_ND + self.shared_experts(x_ND)
        self.aux_loss = load_balancing_loss(probs_NE, expert_NK)
        return out_ND.view(B, T, D)


def load_balancing_loss(probs_NE: torch.Tensor, expert_NK: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i * P_i; f carries no gradient, the router learns through P."""
    N, E = probs_NE.shape
    ones = torch.ones(expert_NK.numel(), dtype=probs_NE.dtype, device=probs_NE.device)
    counts_E = torch.zeros(E, dtype=probs_NE.dtype, device=probs_NE.device).scatter_add_(
        0, expert_NK.reshape(-1), ones
    )
    return E * torch.sum(counts_E / N * probs_NE.mean(dim=0))
