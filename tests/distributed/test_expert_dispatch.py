"""parallel/expert.py's dispatch on 2 gloo ranks against moe.GroupedExperts on one: every token of
both ranks routed to rank 1's experts (2 and 3 of 4), so rank 0 receives no rows and rank 1 sends
none to it (zero-sized splits both ways). The outputs, the input gradients and the expert-weight
gradients (summed over both ranks' tokens) equal one process's; dropless and with a capacity."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from _dist import GlooTestCase, with_comms
from trainfit.models.moe import GroupedExperts
from trainfit.parallel.expert import apply_expert_parallel

NUM_TOKENS, DIM, HIDDEN = 6, 8, 16


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens, their choices (experts 2 and 3, in either order), routing weights, and
    the output gradient its loss gives."""
    g = torch.Generator().manual_seed(rank)
    x_ND = torch.randn(NUM_TOKENS, DIM, generator=g)
    first_N = 2 + torch.randint(0, 2, (NUM_TOKENS,), generator=g)
    expert_NK = torch.stack([first_N, 5 - first_N], dim=1)
    weight_NK = torch.rand(NUM_TOKENS, 2, generator=g).softmax(-1)
    return x_ND, expert_NK, weight_NK, torch.randn(NUM_TOKENS, DIM, generator=g)


class ZeroSizedSplits(GlooTestCase):
    @with_comms
    def test_a_rank_whose_experts_get_no_tokens(self) -> None:
        self.run_subtests({"capacity": [0, 4]}, self._check)

    def _check(self, capacity: int) -> None:
        reference = GroupedExperts(4, DIM, HIDDEN)
        for w in reference.parameters():
            torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(7))
        experts = copy.deepcopy(reference)
        apply_expert_parallel(experts, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)))

        x_ND, expert_NK, weight_NK, grad_ND = _batch(self.rank)
        x_ND.requires_grad_(True)
        out_ND = experts(x_ND, expert_NK, weight_NK, capacity)
        (out_ND * grad_ND).sum().backward()

        reference_loss = torch.zeros(())
        for rank in range(self.world_size):  # one process takes both ranks' tokens, one batch each
            x, expert, weight, grad = _batch(rank)
            x.requires_grad_(True)
            out = reference(x, expert, weight, capacity)
            reference_loss = reference_loss + (out * grad).sum()
            if rank == self.rank:
                torch.testing.assert_close(out_ND, out)
                mine = x
        reference_loss.backward()
        torch.testing.assert_close(x_ND.grad, mine.grad)
        for name, w in experts.named_parameters():
            whole = w.grad.full_tensor()
            torch.testing.assert_close(whole, getattr(reference, name).grad)
            self.assertEqual(float(whole[:2].abs().sum()), 0.0)  # rank 0's experts saw no token
