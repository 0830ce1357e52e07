"""Expert parallelism (GShard, Lepikhin et al. 2020): the routed experts of every MoE layer are
split over the `ep` ranks of an expert group, num_experts / ep each, and every (token, choice) pair
of a rank's tokens travels to the rank holding its expert and back, by all-to-all.

- Ranks (parallel/mesh.py's expert_mesh): among the ranks that shard the model states (dp_shard x
  cp), consecutive blocks of ep ranks are expert groups (the "ep" axis); the ranks holding the same
  experts in different groups form the "edp" axis (dp_shard x cp / ep), over which FSDP2 shards the
  expert weights once more (data_parallel.apply_fsdp).
- Weights: GroupedExperts' stacked w1, w2, w3 become DTensors, Shard(0) on the ep axis. Their names
  and global shapes stay the one-process ones, so DCP checkpoints reshard between layouts.
- Routing is the model's own, on each rank's tokens (top-k, renormalisation, capacity dropping per
  micro-batch, the load-balancing loss); only where the pairs run changes (GroupedExperts.dispatch).
- Dropless: pairs sorted by expert (within one, by token: one rank's order); the per-expert counts
  are exchanged first (an all-to-all of num_experts int64), then the features, with uneven and empty
  splits (`all_to_all_single_autograd`); the local experts run one after the other on the rows they
  received, and the outputs return by the reverse all-to-all, are weighted and summed per token.
- Capacity: the fixed [num_experts x capacity] slot buffers of moe.dispatch_slots travel whole
  (equal splits, nothing to exchange first: GShard's dispatch); a local expert runs on ep x capacity
  rows, the capacity of each source rank's micro-batch side by side.

Gradients: backward runs the same all-to-alls in reverse, so an expert-weight gradient sums the
contributions of the tokens its group routed to it; FSDP2 sums those over edp and must divide by
every rank whose mean loss the step averages (dp_shard x cp), not by edp (apply.py sets it).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainfit.models.moe import GroupedExperts, dispatch_slots, swiglu_experts, swiglu_hidden


class ExpertParallel:
    """GroupedExperts.dispatch over one expert group (the module docstring's two forms)."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, experts: GroupedExperts, x_ND: torch.Tensor, expert_NK: torch.Tensor,
                 weight_NK: torch.Tensor, capacity: int) -> torch.Tensor:
        # This rank's experts, as plain tensors (their gradients flow back into the DTensors).
        weights = tuple(w.to_local() for w in (experts.w1, experts.w2, experts.w3))
        num_experts = experts.w1.shape[0]
        if capacity:
            y_SD, token_S, weight_S = self._capacity(x_ND, expert_NK, weight_NK, num_experts, capacity, weights)
        else:
            y_SD, token_S, weight_S = self._dropless(x_ND, expert_NK, weight_NK, num_experts, weights)
        return torch.zeros_like(x_ND).index_add_(0, token_S, y_SD * weight_S[:, None].to(x_ND.dtype))

    def _dropless(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, weight_NK: torch.Tensor, num_experts: int,
                  weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert output of every pair, its token, its routing weight), pairs sorted by expert."""
        local = num_experts // self.size
        expert_P = expert_NK.reshape(-1)  # token-major: pair p is token p // K's choice p % K
        order_P = torch.argsort(expert_P, stable=True)
        sent_E = torch.bincount(expert_P, minlength=num_experts)
        received_SL = all_to_all_single(sent_E, None, None, self.group).view(self.size, local)
        send, receive = sent_E.view(self.size, local).sum(1).tolist(), received_SL.sum(1).tolist()
        token_P = order_P // expert_NK.shape[1]
        x_RD = all_to_all_single_autograd(x_ND.index_select(0, token_P), receive, send, self.group)
        by_expert_R = expert_major(received_SL)
        y_RD = swiglu_experts(x_RD.index_select(0, by_expert_R), received_SL.sum(0).tolist(), *weights)
        y_RD = y_RD.index_select(0, torch.argsort(by_expert_R))  # back to the order received
        y_PD = all_to_all_single_autograd(y_RD, send, receive, self.group)
        return y_PD, token_P, weight_NK.reshape(-1).index_select(0, order_P)

    def _capacity(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, weight_NK: torch.Tensor, num_experts: int,
                  capacity: int, weights: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert output of every slot, its token, its routing weight); see moe.dispatch_slots."""
        local, D = num_experts // self.size, x_ND.shape[1]
        token_S, weight_S = dispatch_slots(expert_NK, weight_NK, num_experts, capacity)
        x_RD = all_to_all_single_autograd(x_ND.index_select(0, token_S), None, None, self.group)
        # Received: [source rank, local expert, capacity]; each local expert takes all sources' rows.
        x_LCD = x_RD.view(self.size, local, capacity, D).transpose(0, 1).reshape(local, self.size * capacity, D)
        w1, w2, w3 = weights
        y_LCD = torch.bmm(swiglu_hidden(x_LCD, w1, w3), w2.transpose(1, 2))
        y_RD = y_LCD.view(local, self.size, capacity, D).transpose(0, 1).reshape(-1, D)
        return all_to_all_single_autograd(y_RD, None, None, self.group), token_S, weight_S


def expert_major(rows_SL: torch.Tensor) -> torch.Tensor:
    """Where, among rows received from each source rank s for each local expert l (rows_SL[s, l] of
    them, in that order: source-major), the rows of expert 0 then expert 1 ... are (each expert's
    rows from every source together, sources in order)."""
    S, L = rows_SL.shape
    counts = rows_SL.reshape(-1)
    start_LS = (counts.cumsum(0) - counts).view(S, L).t().reshape(-1)
    rows_LS = rows_SL.t().reshape(-1)
    total = int(counts.sum())
    offset_LS = start_LS - (rows_LS.cumsum(0) - rows_LS)  # source position minus expert-major position
    return torch.arange(total, device=rows_SL.device) + torch.repeat_interleave(offset_LS, rows_LS,
                                                                                output_size=total)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Shard the routed experts of every MoE layer of `model` (meta device, before activation
    checkpointing and data parallelism) over the 1-D `ep_mesh`, in place; returns those modules
    (data parallelism shards them on a mesh of their own)."""
    dispatch = ExpertParallel(ep_mesh)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        module.dispatch = dispatch
    return experts
