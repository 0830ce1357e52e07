"""A small block-structured model (of trainfit, only the LayerStack that holds the blocks) for recompute and
memory tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainfit.models.common import LayerStack


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, SDPA attention, LayerNorm, Linear-GELU-Linear."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Net(nn.Module):
    """`layers` of Blocks, the structure apply_activation_checkpointing expects."""

    def __init__(self, dim: int, num_layers: int, num_heads: int = 4) -> None:
        super().__init__()
        self.layers = LayerStack([Block(dim, num_heads) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
