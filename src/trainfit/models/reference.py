"""The documentation's list of the models trainfit reads: each Hugging Face model_type with the
architecture features it maps to, and each preset with its parameter count. Torch-free; drawn from the
same tables the code reads (models/hf.py's types, models/presets.py), so the page cannot drift."""

from __future__ import annotations

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import describe
from trainfit.models.hf import LLAMA_LIKE_TYPES, WRAPPED_TYPES
from trainfit.models.params import format_count, param_counts
from trainfit.models.presets import PRESETS, resolve_model_config


def _features(m: ModelConfig) -> str:
    arch = describe(m)
    layer, a = arch.layers[-1], arch.attention
    parts = ["LayerNorm" if layer.norm.kind == "layer" else "RMSNorm (1 + w)" if layer.norm.offset else "RMSNorm",
             "learned positions" if arch.learned_positions else "RoPE"]
    if a.num_kv_heads != a.num_heads:
        parts.append(f"GQA {a.num_heads}/{a.num_kv_heads}")
    if a.q_dim != arch.dim:
        parts.append(f"head_dim {a.head_dim}")
    if a.qk_norm:
        parts.append("QK-norm" + (" (whole)" if a.qk_norm_whole else ""))
    if layer.norm_placement != "pre":
        parts.append(f"{layer.norm_placement}-norm")
    windows = [la.attention.window for la in arch.layers]
    if any(windows):
        local = sum(1 for w in windows if w)
        parts.append(f"window {max(windows)}" + ("" if local == len(windows) else
                                                 f" in {local} of {len(windows)} layers"))
    if arch.embedding_scale:
        parts.append("scaled embeddings")
    if a.qkv_bias:
        parts.append("q/k/v biases")
    moe = layer.moe
    parts.append(f"MoE {moe.experts} experts top-{moe.top_k}" + (f" + {moe.shared} shared" if moe.shared else "")
                 + ("" if moe.normalize_topk else " (weights not renormalised)")
                 + (f" in {sum(bool(la.moe) for la in arch.layers)} of {len(arch.layers)} layers"
                    if not all(la.moe for la in arch.layers) else "")
                 if moe else ("GeGLU" if layer.mlp.activation == "gelu_tanh" else "SwiGLU") if layer.mlp.gated
                 else "GELU MLP")
    if arch.tie_embeddings:
        parts.append("tied")
    return ", ".join(parts)


def models_reference() -> str:
    """Markdown: the HF model types read and written, then every preset."""
    lines = ["| `model_type` | read as | written back as | stored |", "| --- | --- | --- | --- |"]
    for name, kind in LLAMA_LIKE_TYPES.items():
        features = ["RMSNorm, RoPE, SwiGLU"]
        if kind.qkv_bias:
            features.append("q/k/v biases")
        if kind.qk_norm == "head":
            features.append("QK-norm, head_dim")
        if kind.qk_norm == "whole":
            features.append("QK-norm over all heads")
        if kind.norm_placement == "post":
            features[0] = "RMSNorm after each branch, RoPE, SwiGLU"
        if kind.gemma:
            features = ["(1 + w) RMSNorm before and after each branch, RoPE per layer kind, GeGLU, QK-norm, "
                        "scaled embeddings and queries, windowed and global layers"]
        if kind.experts:
            features.append("routed experts")
        stored = "q, k, v fused; gate, up fused" if kind.fused else "one tensor per projection"
        lines.append(f"| `{name}` | {', '.join(features)} | `{kind.architecture}` | {stored} |")
    for name, text in WRAPPED_TYPES.items():
        lines.append(f"| `{name}` | its text model, as `{text}` (the vision tower is neither trained nor "
                     f"estimated) | `{LLAMA_LIKE_TYPES[text].architecture}` | under the language model's prefix |")
    lines.append("| `gpt2` | LayerNorm, learned positions, GELU MLP, biases | `GPT2LMHeadModel` | q, k, v fused |")
    lines += ["", "| preset | parameters | architecture |", "| --- | ---: | --- |"]
    for name in PRESETS:
        m = resolve_model_config(ModelConfig(preset=name))
        lines.append(f"| `{name}` | {format_count(param_counts(m).total)} | {_features(m)} |")
    return "\n".join(lines) + "\n"
