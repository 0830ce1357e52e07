"""A trained adapter out of trainfit: in PEFT's format (adapter_config.json + adapter_model.safetensors,
which `peft.PeftModel.from_pretrained` loads onto the transformers model of the base), or merged into
the base's weights (HF safetensors, no peft needed to load them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from trainfit.config import ConfigError, ModelConfig, PeftConfig
from trainfit.models.hf import hf_names
from trainfit.models.moe import GroupedExperts
from trainfit.peft import spec
from trainfit.peft.adapters import LoRALinear

PEFT_PREFIX = "base_model.model."
"""What PeftModel puts before the transformers model's own module names."""
MODULES_TO_SAVE = {"tok_embeddings.weight": "embed_tokens", "output.weight": "lm_head"}
"""Fully trained modules beside the adapters (peft.train_embeddings / train_output), PEFT's names."""


def adapter_tensors(model: nn.Module, cfg: ModelConfig, peft: PeftConfig) -> dict[str, torch.Tensor]:
    """The adapters (and fully trained modules) of a plain adapted model, named as PEFT saves them."""
    if cfg.num_experts:  # the routed experts are stacked here, one linear per expert in the checkpoint
        raise ConfigError(f"model.num_experts={cfg.num_experts}: adapters export in PEFT's format for dense models; "
                          "export them merged (trainfit export --merge), which folds every adapter, routed experts' "
                          "too, into the base's weights")
    names = hf_names(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            # Phi-3's fused qkv_proj / gate_up_proj hold several of ours; GPT-2's c_attn too, and its Conv1D
            # weights are stored transposed
            if f"{name}.weight" not in names:
                raise ConfigError(f"model.hf_model_type={cfg.hf_model_type or cfg.family!r}: {name} is stored fused "
                                  "with other linears or transposed in its checkpoint, where PEFT lays an adapter "
                                  "out otherwise; export the adapters merged (trainfit export --merge)")
            theirs = PEFT_PREFIX + names[f"{name}.weight"].removesuffix(".weight")
            out[f"{theirs}.lora_A.weight"] = module.lora_a.detach()
            out[f"{theirs}.lora_B.weight"] = module.lora_b.detach()
            if module.lora_magnitude is not None:
                out[f"{theirs}.lora_magnitude_vector"] = module.lora_magnitude.detach()
    params = dict(model.named_parameters())
    for ours in [n for n in MODULES_TO_SAVE if spec.trains(n, peft) and n in params]:
        out[PEFT_PREFIX + names[ours]] = params[ours].detach()
    return {k: v.contiguous() for k, v in out.items()}


def adapter_config(cfg: ModelConfig, peft: PeftConfig, base: str = "") -> dict:
    """adapter_config.json: what PEFT needs to rebuild the adapters on the base's modules."""
    hf_module = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "w1": "gate_proj",
                 "w3": "up_proj", "w2": "down_proj"}
    modules = [name for ours, name in MODULES_TO_SAVE.items() if spec.trains(ours, peft)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft.rank, "lora_alpha": peft.alpha,
            "lora_dropout": peft.dropout, "target_modules": [hf_module[n] for n in spec.target_names(cfg, peft)],
            "use_dora": peft.method == "dora", "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": modules or None, "base_model_name_or_path": base or None, "inference_mode": True}


def save_adapters(model: nn.Module, cfg: ModelConfig, peft: PeftConfig, out: Path) -> None:
    """adapter_model.safetensors and adapter_config.json in `out` (an existing folder)."""
    from safetensors.torch import save_file

    save_file(adapter_tensors(model, cfg, peft), out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(cfg, peft, cfg.init_from), indent=2) + "\n")


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold each adapter into its base weight, in place (the adapters stay, zeroed, so the model still
    computes the same): LoRA W + s B A (a routed expert's W[e] + s B[e] A[e]); DoRA
    m (W + s B A) / ||W + s B A||_row."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, adapter in module.adapters.items():
                getattr(module, name).add_(adapter.scale * torch.bmm(adapter.lora_b, adapter.lora_a))
                adapter.lora_b.zero_()
        if isinstance(module, LoRALinear):
            merged = module.weight + module.scale * (module.lora_b @ module.lora_a)
            if module.lora_magnitude is not None:
                merged = merged * (module.lora_magnitude / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
                module.lora_magnitude.copy_(torch.linalg.vector_norm(merged, dim=1))
            module.weight.copy_(merged)
            module.lora_b.zero_()
