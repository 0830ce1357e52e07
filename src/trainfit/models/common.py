"""Parts both model families and the MoE share: the SwiGLU MLP and the output head (the weight
init is models/init.py).

Here so that llama.py imports moe.py and gpt2.py imports nothing of llama.py: one direction only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down one."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


def output_head(model: nn.Module, h_BTD: torch.Tensor) -> torch.Tensor:
    """Final norm and output projection, each skipped when a pipeline stage has none."""
    if model.norm is not None:
        h_BTD = model.norm(h_BTD)
    return model.output(h_BTD) if model.output is not None else h_BTD
