"""LoRA and DoRA adapters on a model's block linears, as peft/spec.py describes them, and the base
frozen. Applied on the meta device right after the model is built (train/build.py), so the
parallelizer, the trainer and the traced estimator all see the adapted model.

An adapted linear stays an nn.Linear (LoRALinear subclasses it) whose weight and bias keep their
names, so checkpoints of the base, HF weight loading and activation checkpointing's policies read
it unchanged; its adapter is three parameters beside them (spec.ADAPTER_SUFFIXES), initialized by
name like every parameter (models/init.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.init import canonical_name
from trainfit.models.moe import GroupedExperts, LowRank
from trainfit.peft import spec


class LoRALinear(nn.Linear):
    """W x + b + s B A dropout(x), s = alpha / rank; with a magnitude (DoRA), the whole W x + s B A x
    scaled per output row by m / ||W + s B A||_row, the norm detached as DoRA's paper (section 4.3)
    and PEFT do, so backward keeps no graph of it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, peft: PeftConfig,
                 device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.lora_a = nn.Parameter(torch.empty(peft.rank, in_features, device=device))
        self.lora_b = nn.Parameter(torch.empty(out_features, peft.rank, device=device))
        self.lora_magnitude = nn.Parameter(torch.empty(out_features, device=device)) if peft.method == "dora" else None
        self.scale = peft.alpha / peft.rank
        self.lora_dropout = nn.Dropout(peft.dropout) if peft.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_a), self.lora_b) * self.scale
        if self.lora_magnitude is None:
            out = base + update
        else:
            with torch.no_grad():
                norm = torch.linalg.vector_norm(self.weight + self.scale * (self.lora_b @ self.lora_a), dim=1)
            out = (self.lora_magnitude / norm) * (base + update)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        kind = "dora" if self.lora_magnitude is not None else "lora"
        return f"{super().extra_repr()}, {kind} rank={self.lora_a.shape[0]}, scale={self.scale:g}"


class ExpertLoRA(nn.Module):
    """LoRA on a routed-experts weight [E, out, in] (models/moe.py): one adapter per expert, stacked
    like the weight (lora_a [E, rank, in], lora_b [E, out, rank]), so expert parallelism and FSDP
    split them with it; GroupedExperts adds expert e's s B[e] A[e] x beside its matmul."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, peft: PeftConfig,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.empty(num_experts, peft.rank, in_features, device=device))
        self.lora_b = nn.Parameter(torch.empty(num_experts, out_features, peft.rank, device=device))
        self.scale = peft.alpha / peft.rank
        self.lora_dropout = nn.Dropout(peft.dropout) if peft.dropout else nn.Identity()

    def low_rank(self, local: bool) -> LowRank:
        a, b = (p.to_local() if local else p for p in (self.lora_a, self.lora_b))
        return LowRank(a, b, self.scale, self.lora_dropout)

    def extra_repr(self) -> str:
        return f"experts={self.lora_a.shape[0]}, lora rank={self.lora_a.shape[1]}, scale={self.scale:g}"


def apply_adapters(model: nn.Module, cfg: ModelConfig, peft: PeftConfig) -> nn.Module:
    """Swap each targeted block linear for a LoRALinear, and give each targeted routed-experts weight
    its ExpertLoRA (on the meta device); freeze every parameter spec.trains leaves out. In place; the
    model unchanged without PEFT."""
    if not spec.enabled(peft):
        return model
    adapted = [a.linear for a in spec.block_adapters(cfg, peft)]
    for block in model.layers:
        for linear in adapted:
            parent_path, _, name = linear.path.rpartition(".")
            parent = block.get_submodule(parent_path)
            if linear.routed:
                experts: GroupedExperts = parent
                weight = getattr(experts, name)
                experts.adapters[name] = ExpertLoRA(linear.copies, linear.in_features, linear.out_features, peft,
                                                    device=weight.device)
                continue
            old: nn.Linear = getattr(parent, name)
            setattr(parent, name, LoRALinear(old.in_features, old.out_features, old.bias is not None, peft,
                                             device=old.weight.device))
    for name, param in model.named_parameters():
        param.requires_grad_(spec.trains(canonical_name(name), peft))
    return model
