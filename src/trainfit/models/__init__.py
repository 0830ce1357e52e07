"""Model families and the one entry point that builds them.

torch is imported inside the functions: config validation imports `trainfit.models.presets` (and so
this package), and the config path and the analytic estimator must stay torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainfit.config.schema import ConfigError, ModelConfig
from trainfit.models.presets import resolve_model_config

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["build_model", "count_params", "materialize"]


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model for `cfg` on the meta device (no memory). Materialize it with
    `materialize(model, device, seed)` (or load weights after that)."""
    import torch

    cfg = resolve_model_config(dataclasses.replace(cfg))
    with torch.device("meta"):
        # model.family picks the module tree (one of the few places it is read: docs/contributing/adding.md)
        if cfg.family == "llama":
            from trainfit.models.llama import Transformer

            return Transformer(cfg)
        if cfg.family == "gpt2":
            from trainfit.models.gpt2 import GPT2

            return GPT2(cfg)
    raise ConfigError(f"model.family={cfg.family!r}: choose llama or gpt2")


def count_params(model: nn.Module) -> int:
    """Parameters counted once each (a tied embedding/output pair counts once); works on meta."""
    unique = {id(p): p.numel() for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(unique.values())


def materialize(model: nn.Module, device: torch.device | str, seed: int = 0) -> nn.Module:
    """Allocate a meta-device model (plain or parallelized: then each rank allocates only what it
    holds) on `device` and initialize it from `seed`: the same values on every layout
    (models/init.py). Also rebuilds non-persistent buffers (RoPE tables), so call it before
    loading weights too."""
    import torch

    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(seed)
    return model
