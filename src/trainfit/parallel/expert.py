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
every rank whose mean loss the step averages (dp_shard x cp), not by edp (train/parallelize.py sets it).

Shape suffixes (moe.py's, and): P the rank's (token, choice) pairs, R rows it receives, G ranks of
its expert group, L its local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainfit.models.moe import ExpertWeights, GroupedExperts, dispatch_slots, swiglu_experts, swiglu_hidden


@dataclass(frozen=True)
class Routes:
    """Where a rank's dropless pairs go and what it receives: the one step that reads the routing's
    values (the traced estimator stands in for it: traced.py)."""

    order_P: torch.Tensor
    """The rank's (token, choice) pairs, token-major, sorted by expert (stably: by token within one)."""
    send: list[int]
    """Rows to each rank of the group."""
    receive: list[int]
    """Rows from each rank of the group."""
    rows_L: list[int]
    """Rows received for each local expert, from every source rank."""
    by_expert_R: torch.Tensor
    """The received rows, expert by expert (expert_major)."""


class ExpertParallel:
    """GroupedExperts.dispatch over one expert group (the module docstring's two forms). Buffers die
    as soon as they are consumed: nothing outlives its step but what autograd saves."""

    def __init__(self, ep_mesh: DeviceMesh) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, experts: GroupedExperts, x_ND: torch.Tensor, expert_NK: torch.Tensor,
                 weight_NK: torch.Tensor, capacity: int) -> torch.Tensor:
        # This rank's experts, as plain tensors (their gradients flow back into the DTensors).
        weights = experts.weights(local=True)
        num_experts = experts.w1.shape[0]
        if capacity:
            token_S, weight_S = dispatch_slots(expert_NK, weight_NK, num_experts, capacity)
            return _combine(x_ND, token_S, weight_S, self._capacity(x_ND, token_S, capacity, weights))
        routes = self.routes(expert_NK, num_experts)
        token_P = routes.order_P // expert_NK.shape[1]
        weight_P = weight_NK.reshape(-1).index_select(0, routes.order_P)
        return _combine(x_ND, token_P, weight_P, self._dropless(x_ND, token_P, routes, weights))

    def routes(self, expert_NK: torch.Tensor, num_experts: int) -> Routes:
        """This rank's Routes: its pairs by expert, and every rank's counts per expert exchanged (an
        all-to-all of num_experts int64), which the feature all-to-alls need as split sizes."""
        expert_P = expert_NK.reshape(-1)  # token-major: pair p is token p // K's choice p % K
        sent_E = torch.bincount(expert_P, minlength=num_experts)
        rows_GL = all_to_all_single(sent_E, None, None, self.group).view(self.size, -1)
        return Routes(torch.argsort(expert_P, stable=True), sent_E.view(self.size, -1).sum(1).tolist(),
                      rows_GL.sum(1).tolist(), rows_GL.sum(0).tolist(), expert_major(rows_GL))

    def _dropless(self, x_ND: torch.Tensor, token_P: torch.Tensor, routes: Routes,
                  weights: ExpertWeights) -> torch.Tensor:
        """The experts' outputs for the rank's pairs (their tokens token_P, sorted by expert)."""
        x_RD = self._send(x_ND.index_select(0, token_P), routes.receive, routes.send).index_select(
            0, routes.by_expert_R)
        # x_RD is the experts' input, which autograd keeps anyway; their outputs go back in received order
        y_RD = swiglu_experts(x_RD, routes.rows_L, weights).index_select(0, torch.argsort(routes.by_expert_R))
        return self._send(y_RD, routes.send, routes.receive)

    def _capacity(self, x_ND: torch.Tensor, token_S: torch.Tensor, capacity: int,
                  weights: ExpertWeights) -> torch.Tensor:
        """The experts' outputs for the rank's slots (their tokens token_S, [experts x capacity])."""
        x_LCD = self._by_expert(self._send(x_ND.index_select(0, token_S)), capacity)
        return self._send(self._by_source(weights.batched("w2", swiglu_hidden(x_LCD, weights)), capacity))

    def _send(self, x: torch.Tensor, receive: list[int] | None = None, send: list[int] | None = None
              ) -> torch.Tensor:
        """All-to-all of x's rows: `send` to each rank, `receive` from each (None: equal splits).
        Called on temporaries, so that each buffer dies with its all-to-all."""
        return all_to_all_single_autograd(x, receive, send, self.group)

    def _by_expert(self, x_RD: torch.Tensor, capacity: int) -> torch.Tensor:
        """Received capacity slots [source rank, local expert, capacity] -> [local expert, every
        source's capacity]: each local expert takes all its rows at once."""
        D = x_RD.shape[-1]
        return x_RD.view(self.size, -1, capacity, D).transpose(0, 1).reshape(-1, self.size * capacity, D)

    def _by_source(self, y_LCD: torch.Tensor, capacity: int) -> torch.Tensor:
        """_by_expert's inverse, flattened to rows for the all-to-all back."""
        D = y_LCD.shape[-1]
        return y_LCD.view(-1, self.size, capacity, D).transpose(0, 1).reshape(-1, D)


def _combine(x_ND: torch.Tensor, token_X: torch.Tensor, weight_X: torch.Tensor, y_XD: torch.Tensor) -> torch.Tensor:
    """Each expert output row (X: slots, or pairs) times its routing weight, summed into its token,
    as GroupedExperts does on one rank."""
    return torch.zeros_like(x_ND).index_add_(0, token_X, y_XD * weight_X[:, None].to(x_ND.dtype))


def expert_major(rows_GL: torch.Tensor) -> torch.Tensor:
    """Where, among rows received from each source rank s for each local expert l (rows_GL[s, l] of
    them, in that order: source-major), the rows of expert 0 then expert 1 ... are (each expert's
    rows from every source together, sources in order)."""
    G, L = rows_GL.shape
    counts = rows_GL.reshape(-1)
    start_LG = (counts.cumsum(0) - counts).view(G, L).t().reshape(-1)
    rows_LG = rows_GL.t().reshape(-1)
    total = int(counts.sum())
    offset_LG = start_LG - (rows_LG.cumsum(0) - rows_LG)  # source position minus expert-major position
    return torch.arange(total, device=rows_GL.device) + torch.repeat_interleave(offset_LG, rows_LG,
                                                                                output_size=total)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Shard the routed experts of every MoE layer of `model` (meta device, before activation
    checkpointing and data parallelism) over the 1-D `ep_mesh`, in place; returns those modules
    (data parallelism shards them on a mesh of their own)."""
    dispatch = ExpertParallel(ep_mesh)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for module in experts:
        for name, param in list(module.named_parameters()):  # the weights, and any adapters stacked like them
            owner_path, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            owner.register_parameter(attr, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)]),
                                                        requires_grad=param.requires_grad))
        module.dispatch = dispatch
    return experts
