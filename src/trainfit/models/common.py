"""Parts both model families and the MoE share: the SwiGLU MLP, the output head, the weight init.

Here so that llama.py imports moe.py and gpt2.py imports nothing of llama.py: one direction only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02
# Residual-branch output projections; their init std is scaled by 1/sqrt(2 * num_layers) (GPT-2 paper).
RESIDUAL_SUFFIXES = ("wo.weight", "w2.weight", "experts.w2")


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


def init_params(model: nn.Module, num_layers: int) -> None:
    """Re-tie shared embeddings (to_empty() unties them), then normal(0, 0.02) for weights, scaled by
    1/sqrt(2 * num_layers) on residual output projections; ones for norm gains, zeros for biases.
    Named-parameter order makes it deterministic per seed."""
    if model.cfg.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight
    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(param)
        elif name.rsplit(".", 2)[-2].endswith("norm"):
            nn.init.ones_(param)
        elif name.endswith(RESIDUAL_SUFFIXES):
            nn.init.normal_(param, mean=0.0, std=residual_std)
        else:
            nn.init.normal_(param, mean=0.0, std=INIT_STD)
