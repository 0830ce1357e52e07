"""Named model sizes, and the resolution of a ModelConfig from its preset. Torch-free."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError, ModelConfig

# Values every model gets when neither the preset nor the user sets them.
DEFAULTS: dict[str, Any] = {
    "family": "llama",
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_embeddings": False,
    "qkv_bias": False,
    "num_experts": 0,
    "experts_per_token": 2,
    "num_shared_experts": 0,
    "router_aux_loss_coef": 0.01,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Defaults of `trainfit train`: a char-level Llama of ~3M parameters that learns
    # Shakespeare on 2 CPU cores in about two minutes.
    "tiny": dict(dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=768,
                 vocab_size=256, max_seq_len=512),
    # Smallest useful shapes, for tests.
    "debug": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
                  vocab_size=256, max_seq_len=128),
    "debug-moe": dict(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
                      vocab_size=256, max_seq_len=128, num_experts=4, experts_per_token=2,
                      num_shared_experts=1, expert_ffn_dim=64),
    "debug-gpt2": dict(family="gpt2", dim=64, num_layers=2, num_heads=4, ffn_dim=256,
                       vocab_size=256, max_seq_len=128, tie_embeddings=True),
}


def preset_fields(preset: str) -> dict[str, Any]:
    """The field values a preset name or an HF config.json path stands for."""
    if preset in PRESETS:
        return dict(PRESETS[preset])
    if preset.endswith(".json") or Path(preset).is_dir():
        from trainfit.models.hf import model_fields_from_hf_config

        return model_fields_from_hf_config(preset)
    raise ConfigError(
        f"model.preset={preset!r}: unknown preset; choose one of {', '.join(sorted(PRESETS))}, "
        "give a path to an HF config.json, or set model.preset='' and every dimension"
    )


def resolve_model_config(model: ModelConfig) -> ModelConfig:
    """Fill the fields left unset (None) from the preset, then from DEFAULTS, in place."""
    base = preset_fields(model.preset) if model.preset else {}
    for f in dataclasses.fields(model):
        if getattr(model, f.name) is None:
            setattr(model, f.name, base.get(f.name, DEFAULTS.get(f.name)))
    if model.num_kv_heads is None:
        model.num_kv_heads = model.num_heads
    if model.expert_ffn_dim is None:
        model.expert_ffn_dim = model.ffn_dim
    return model
