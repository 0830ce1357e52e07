"""Routed-experts feed-forward (Mixtral style) with optional shared experts.

Names: `router` (Linear dim -> num_experts; biased in gpt-oss), `experts.{w1,w2,w3}` stacked [E, F, D] /
[E, D, F] / [E, F, D] (w1 gate, w3 up, w2 down, as in torchtitan's GroupedExperts, so expert
parallelism can shard dim 0), `shared_experts.{w1,w2,w3}` (one SwiGLU of width
num_shared_experts * expert_ffn_dim, which equals the sum of that many experts of width expert_ffn_dim).
gpt-oss's experts add `experts.{w1,w2,w3}_bias` [E, out] and compute a clamped SwiGLU (Glu).

Routing matches transformers' Mixtral: softmax over all experts in fp32, top-k, renormalize the k
weights (the same as a softmax over the top-k logits); with model.router_normalize_topk false the k
weights stay the softmax's (OLMoE, Qwen3-MoE's norm_topk_prob false).

Two ways to run the experts (models/routing.py sizes both for the estimators):
- dropless (model.capacity_factor = 0, and always outside training): each expert runs on exactly the
  tokens routed to it, one expert after the other; the busiest expert's tensors grow with the
  router's imbalance.
- capacity (capacity_factor > 0, training only): each expert takes at most C =
  routing.expert_capacity(...) (token, choice) pairs, every token's first choice before any second
  choice (GShard's order), then by position in the micro-batch; the rest are dropped and those
  tokens keep only the residual (Switch Transformer, GShard). All experts run as one batched matmul
  on [E, C] buffers; empty rows read token 0 with weight 0 and contribute nothing.

Expert parallelism (parallel/expert.py) keeps the routing here as it is and swaps only where the
routed pairs run: `GroupedExperts.dispatch`, None on one rank, sends each pair to the rank holding
its expert and back (the module's own forward, so FSDP2 gathers the experts' weights around it).

Shape suffixes: B batch, T sequence, N tokens (B*T), D model dim, E experts, K experts per token,
F expert hidden, M tokens routed to one expert, C expert capacity, S expert slots (E*C), P
(token, choice) pairs (K*N, choice-major).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from trainfit.config.schema import ModelConfig
from trainfit.models.common import FeedForward
from trainfit.models.routing import expert_capacity


class LowRank(NamedTuple):
    """A low-rank update of one stacked expert weight (LoRA's, built by peft/): expert e's weight W[e]
    computes as W[e] + scale b[e] a[e], its input through `dropout` first."""

    a: torch.Tensor
    """[E, rank, in]."""
    b: torch.Tensor
    """[E, out, rank]."""
    scale: float
    dropout: nn.Module


class ExpertAdapter(Protocol):
    """What GroupedExperts.adapters holds per stacked weight (peft/adapters.py builds them)."""

    def low_rank(self, local: bool) -> LowRank:
        """Its tensors (`local`: this rank's experts' slices of expert-parallel DTensors)."""
        ...


class Glu(NamedTuple):
    """How an expert's hidden is made of its gate (w1 x) and up (w3 x) projections: SwiGLU, silu(gate) * up,
    or with `limit` > 0 gpt-oss's clamped form (model.swiglu_limit): gate clamped to at most the limit, up
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    limit: float = 0.0
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self.limit:
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SWIGLU = Glu()
_NONE: Mapping[str, torch.Tensor] = MappingProxyType({})


class ExpertWeights(NamedTuple):
    """The stacked weights a computation of the experts reads, their biases if any, and any low-rank
    updates of them."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    updates: Mapping[str, LowRank]
    """By weight name (w1, w2, w3): the adapted ones."""
    biases: Mapping[str, torch.Tensor] = _NONE
    """By weight name: [E, out] (gpt-oss's experts); empty: none."""
    glu: Glu = SWIGLU

    def linear(self, name: str, x_MD: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's weight `name` (and bias) on its rows x."""
        bias = self.biases.get(name)
        y = F.linear(x_MD, getattr(self, name)[e], None if bias is None else bias[e])
        update = self.updates.get(name)
        if update is None:
            return y
        return y + F.linear(F.linear(update.dropout(x_MD), update.a[e]), update.b[e]) * update.scale

    def batched(self, name: str, x_ECD: torch.Tensor) -> torch.Tensor:
        """Every expert's weight `name` (and bias) on its rows x[e], in batched matmuls."""
        bias = self.biases.get(name)
        y = torch.bmm(x_ECD, getattr(self, name).transpose(1, 2))
        if bias is not None:
            y = y + bias[:, None, :]
        update = self.updates.get(name)
        if update is None:
            return y
        low = torch.bmm(update.dropout(x_ECD), update.a.transpose(1, 2))
        return y + torch.bmm(low, update.b.transpose(1, 2)) * update.scale

    def hidden(self, x_MD: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's hidden [M, F] on its rows."""
        return self.glu(self.linear("w1", x_MD, e), self.linear("w3", x_MD, e))

    def hidden_batched(self, x_ECD: torch.Tensor) -> torch.Tensor:
        """Every expert's hidden [E, C, F] on its rows x[e]."""
        return self.glu(self.batched("w1", x_ECD), self.batched("w3", x_ECD))


class GroupedExperts(nn.Module):
    """num_experts SwiGLU MLPs stored as stacked weights; `adapters` (empty unless peft/ adds some)
    update some of them by low-rank terms computed beside each matmul, never merged in."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, bias: bool = False, glu: Glu | None = None
                 ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        if bias:  # gpt-oss's: [E, out] beside each stacked weight
            self.w1_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))
            self.w3_bias = nn.Parameter(torch.empty(num_experts, hidden_dim))
        self.bias, self.glu = bias, glu or SWIGLU
        self.adapters = nn.ModuleDict()
        """ExpertAdapter modules by weight name (w1, w2, w3)."""
        self.dispatch: ExpertDispatch | None = None
        """Runs the routed pairs on experts spread over ranks (parallel/expert.py); None: all here."""

    def weights(self, local: bool = False) -> ExpertWeights:
        """The weights and updates to compute with (`local`: expert parallelism's own slices)."""
        w1, w2, w3 = (w.to_local() if local else w for w in (self.w1, self.w2, self.w3))
        biases = {name: getattr(self, f"{name}_bias") for name in ("w1", "w2", "w3")} if self.bias else {}
        if local:
            biases = {name: b.to_local() for name, b in biases.items()}
        return ExpertWeights(w1, w2, w3, {name: adapter.low_rank(local) for name, adapter in self.adapters.items()},
                             biases, self.glu)

    def forward(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, weight_NK: torch.Tensor,
                capacity: int = 0) -> torch.Tensor:
        """Dropless (capacity 0): each expert runs on exactly the tokens routed to it, one after the
        other; index_add_ is deterministic on CPU. Capacity > 0: every expert on a [capacity] buffer
        of its kept tokens (see the module docstring), all in one batched matmul."""
        if self.dispatch is not None:
            return self.dispatch(self, x_ND, expert_NK, weight_NK, capacity)
        if capacity:
            return self._forward_capacity(x_ND, expert_NK, weight_NK, capacity)
        out_ND = torch.zeros_like(x_ND)
        w = self.weights()
        for e in range(self.w1.shape[0]):
            token_M, slot_M = torch.nonzero(expert_NK == e, as_tuple=True)
            x_MD = x_ND.index_select(0, token_M)
            h_MF = w.hidden(x_MD, e)
            y_MD = w.linear("w2", h_MF, e) * weight_NK[token_M, slot_M, None].to(x_ND.dtype)
            out_ND.index_add_(0, token_M, y_MD)
        return out_ND

    def _forward_capacity(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, weight_NK: torch.Tensor,
                          capacity: int) -> torch.Tensor:
        D, E = x_ND.shape[1], self.w1.shape[0]
        token_S, weight_S = dispatch_slots(expert_NK, weight_NK, E, capacity)
        w = self.weights()
        h_ECF = self._hidden(x_ND.index_select(0, token_S).view(E, capacity, D), w)
        y_SD = w.batched("w2", h_ECF).reshape(E * capacity, D) * weight_S[:, None].to(x_ND.dtype)
        return torch.zeros_like(x_ND).index_add_(0, token_S, y_SD)

    @staticmethod
    def _hidden(x_ECD: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        """SwiGLU hidden of all experts; the gathered input dies on return (under autocast only its
        casts are saved; an adapter keeps it)."""
        return swiglu_hidden(x_ECD, w)


class ExpertDispatch(Protocol):
    """What replaces GroupedExperts' own loop when its experts are spread over ranks: the output
    [N, D] of `experts` for the routed pairs, as GroupedExperts.forward computes it on one rank."""

    def __call__(self, experts: GroupedExperts, x_ND: torch.Tensor, expert_NK: torch.Tensor,
                 weight_NK: torch.Tensor, capacity: int) -> torch.Tensor: ...


def swiglu_experts(x_MD: torch.Tensor, rows: list[int], w: ExpertWeights) -> torch.Tensor:
    """Experts i of `w` each on its block of `rows[i]` consecutive rows of x, one after the other (a
    loop: torch._grouped_mm has no CPU backward in torch 2.13)."""
    return torch.cat([w.linear("w2", w.hidden(x, i), i) for i, x in enumerate(x_MD.split(rows))])


def swiglu_hidden(x_ECD: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """The hidden [E, C, F] of every expert e on its rows x[e], in batched matmuls."""
    return w.hidden_batched(x_ECD)


@torch.no_grad()
def _slot_of_pairs(expert_NK: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Each (token, choice) pair's slot expert * capacity + its rank among the expert's pairs, in
    choice-major then position order; dropped pairs (rank >= capacity) get the spare slot E * C."""
    expert_P = expert_NK.t().reshape(-1)
    onehot_PE = (expert_P[:, None] == torch.arange(num_experts, device=expert_P.device)).to(torch.int32)
    rank_P = onehot_PE.cumsum(0, dtype=torch.int32).gather(1, expert_P[:, None]).squeeze(1) - 1
    spare = torch.full_like(expert_P, num_experts * capacity)
    return torch.where(rank_P < capacity, expert_P * capacity + rank_P, spare)


def dispatch_slots(expert_NK: torch.Tensor, weight_NK: torch.Tensor, num_experts: int, capacity: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of every expert slot, its routing weight): [E * C] each, slot e * C + r holding expert
    e's r-th kept pair; empty slots hold token 0 with weight 0. Gradients reach the kept weights."""
    N, K = expert_NK.shape
    slot_P = _slot_of_pairs(expert_NK, num_experts, capacity)
    token_P = torch.arange(N, device=expert_NK.device).repeat(K)
    slots = num_experts * capacity + 1  # + the spare slot, where dropped pairs land and are cut off
    token_S = torch.zeros(slots, dtype=torch.long, device=expert_NK.device).scatter_(0, slot_P, token_P)
    weight_S = torch.zeros(slots, dtype=weight_NK.dtype, device=weight_NK.device).scatter(
        0, slot_P, weight_NK.t().reshape(-1))
    return token_S[:-1], weight_S[:-1]


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
        self.capacity_factor = cfg.capacity_factor or 0.0
        self.normalize_topk = bool(cfg.router_normalize_topk)
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=bool(cfg.router_bias))
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_ffn_dim, bias=bool(cfg.expert_bias),
                                      glu=Glu(cfg.swiglu_limit or 0.0, cfg.swiglu_alpha or 1.702))
        shared_dim = cfg.num_shared_experts * cfg.expert_ffn_dim
        self.shared_experts = FeedForward(cfg.dim, shared_dim) if shared_dim else None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        probs_NE = F.softmax(self.router(x_ND).float(), dim=-1)
        weight_NK, expert_NK = probs_NE.topk(self.top_k, dim=-1)
        if self.normalize_topk:
            weight_NK = weight_NK / weight_NK.sum(dim=-1, keepdim=True)
        capacity = 0
        if self.training and self.capacity_factor > 0:
            capacity = expert_capacity(x_ND.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        out_ND = self.experts(x_ND, expert_NK, weight_NK, capacity)
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
