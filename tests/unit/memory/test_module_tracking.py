"""The ledger's module tracker (memory/traced/ledger.py) names the module each tensor is made in. A backward
that runs inside a forward (a kernel tracing its own backward graph on first call; torch.autograd.grad in a
model's code) must not lose the forward's module stack: on a GPU's first step of FlexAttention this failed
the step with torch's "Module hierarchy tracking is wrong"."""

from __future__ import annotations

import torch
from torch import nn

from trainfit.memory.traced.ledger import _StageSafeModTracker


class GradInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        torch.autograd.grad(h.square().sum(), self.first.weight, retain_graph=True)  # a backward within forward
        return self.second(h)


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = GradInForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_backward_inside_a_forward_keeps_the_forwards_module_stack() -> None:
    model, seen = Top(), {}
    tracker = _StageSafeModTracker()

    def note(module: nn.Module, _inputs: object) -> None:
        if module is model.inner.second:
            seen["second"] = set(tracker.parents)

    tracker.register_user_hooks(pre_fw_hook=note)
    with tracker:
        out = model(torch.randn(4, 8))
        assert tracker.parents == {"Global"}  # every forward returned, in order
        out.sum().backward()
    assert {"Top", "Top.inner", "Top.inner.second"} <= seen["second"]  # named after the inner backward
    assert model.inner.first.weight.grad is not None and model.inner.second.weight.grad is not None
