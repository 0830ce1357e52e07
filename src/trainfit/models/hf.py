"""Hugging Face interop: config.json -> ModelConfig fields (torch-free), safetensors weights in and out.

Supported `model_type`s: the llama-family ones of LLAMA_LIKE_TYPES (llama, mistral, mixtral, qwen2/3,
qwen3_moe, olmo2, phi3, gemma3_text and the text model of gemma3) and gpt2. Weight names are
mapped by explicit groups (ours <-> theirs, with a conversion each way), so loading checks that
every tensor of the checkpoint is used and every parameter of ours is filled with the right shape.
torch and safetensors are imported inside the weight functions only.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainfit.config.schema import ConfigError, ModelConfig
from trainfit.models.architecture import describe, moe_layer

if TYPE_CHECKING:
    import torch
    from torch import nn

@dataclass(frozen=True)
class HfType:
    """What one llama-like `model_type` is in the architecture's terms, and how its checkpoint names
    the weights. transformers' defaults for keys a config.json may omit: `eps`, `theta`, `head_dim`."""

    architecture: str
    eps: float = 1e-6
    theta: float = 10000.0
    head_dim: int = 0
    """transformers' default head width (0: hidden_size / num_attention_heads)."""
    qkv_bias: bool = False
    qk_norm: str = "none"
    norm_placement: str = "pre"
    experts: str = ""
    """How routed experts are configured and named: "" none, "mixtral", "qwen3_moe" or "olmoe"."""
    fused: bool = False
    """Phi-3: q, k, v stored as one qkv_proj, gate and up as one gate_up_proj."""
    window: bool = False
    """Its config.json's sliding_window is every layer's (Mistral, Mixtral, Phi-3) or every windowed layer's
    (Gemma), so a model with model.sliding_window can be written as it."""
    gemma: bool = False
    """Gemma's features: (1 + w) norms, sandwich norms, GeGLU, sqrt(dim)-scaled embeddings, a query scale,
    windowed layers among global ones (sliding_window_pattern or layer_types), their own RoPE base."""
    defaults: tuple[tuple[str, Any], ...] = ()
    """transformers' values for keys a config.json may omit (Gemma 3's hub files omit most)."""
    local_rope: bool = False
    """Gemma 3: the windowed layers have a RoPE base of their own, and RoPE scaling is the global ones'."""
    softcaps: bool = False
    """Gemma 2: soft-capped attention scores (attn_logit_softcapping; both Gemmas read
    final_logit_softcapping, the logits')."""
    gpt_oss: bool = False
    """gpt-oss's features: o_proj biased with q, k, v; attention sinks; a biased router; biased experts with
    the clamped SwiGLU, stored as one interleaved gate_up_proj [E, dim, 2 x width] and a down_proj
    [E, width, dim]; windowed and full layers alternating (layer_types)."""


GEMMA3_TEXT_DEFAULTS = (
    ("vocab_size", 262_208), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
    ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"), ("max_position_embeddings", 131_072), ("rms_norm_eps", 1e-6),
    ("rope_local_base_freq", 10_000.0), ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096), ("sliding_window_pattern", 6), ("tie_word_embeddings", True))
"""Gemma3TextConfig's defaults (transformers 5: configuration_gemma3.py)."""
GEMMA2_DEFAULTS = (
    ("vocab_size", 256_000), ("hidden_size", 2304), ("intermediate_size", 9216), ("num_hidden_layers", 26),
    ("num_attention_heads", 8), ("num_key_value_heads", 4), ("head_dim", 256),
    ("hidden_activation", "gelu_pytorch_tanh"), ("max_position_embeddings", 8192), ("rms_norm_eps", 1e-6),
    ("query_pre_attn_scalar", 256), ("sliding_window", 4096), ("sliding_window_pattern", 2),
    ("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0), ("tie_word_embeddings", True))
"""Gemma2Config's defaults (configuration_gemma2.py; its layer_types alternate, windowed first)."""


LLAMA_LIKE_TYPES = {
    "llama": HfType("LlamaForCausalLM"),
    "mistral": HfType("MistralForCausalLM", window=True),
    "mixtral": HfType("MixtralForCausalLM", eps=1e-5, theta=1e6, experts="mixtral", window=True),
    "qwen2": HfType("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": HfType("Qwen3ForCausalLM", head_dim=128, qk_norm="head"),
    "qwen3_moe": HfType("Qwen3MoeForCausalLM", head_dim=128, qk_norm="head", experts="qwen3_moe"),
    "olmo2": HfType("Olmo2ForCausalLM", eps=1e-5, qk_norm="whole", norm_placement="post"),
    "olmoe": HfType("OlmoeForCausalLM", eps=1e-5, qk_norm="whole", experts="olmoe"),
    "phi3": HfType("Phi3ForCausalLM", eps=1e-5, fused=True, window=True),
    "gemma2": HfType("Gemma2ForCausalLM", theta=1e4, norm_placement="sandwich", gemma=True, defaults=GEMMA2_DEFAULTS,
                     softcaps=True, window=True),
    "gemma3_text": HfType("Gemma3ForCausalLM", theta=1e6, qk_norm="head", norm_placement="sandwich", gemma=True,
                          defaults=GEMMA3_TEXT_DEFAULTS, local_rope=True, window=True),
    "gpt_oss": HfType("GptOssForCausalLM", eps=1e-5, theta=150000.0, head_dim=64, qkv_bias=True, experts="gpt_oss",
                      window=True, gpt_oss=True),
}
"""The llama-family model types, each a mapping from its config.json (_llama_fields) and its weight
names (_llama_groups); a new one is an entry here when its features are the architecture's."""
LLAMA_TYPES = tuple(LLAMA_LIKE_TYPES)
WRAPPED_TYPES = {"gemma3": "gemma3_text"}
"""Multimodal model types whose text model (config.json's text_config, its weights under the language
model's prefix) trainfit trains and estimates; the vision tower is neither (a warning names it)."""
SUPPORTED_TYPES = (*LLAMA_TYPES, *WRAPPED_TYPES, "gpt2")
_REQUIRED = object()
# Checkpoint entries that are buffers, not weights (old GPT-2 masks, old Llama inv_freq).
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")


# ---------------------------------------------------------------- config.json


def _read_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"model.preset={str(path)!r}: no config.json there; give an HF config.json "
                          "or a folder holding one")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.preset={str(path)!r}: {file} is not valid JSON ({err}); give an HF "
                          "config.json") from err
    if not isinstance(hf, dict):
        raise ConfigError(f"model.preset={str(path)!r}: {file} holds a {type(hf).__name__}, not a JSON object; "
                          "give an HF config.json")
    return hf, file


_KINDS: dict[str, type | tuple[type, ...]] = {
    "hidden_act": str, "activation_function": str, "tie_word_embeddings": bool,
    "rms_norm_eps": (int, float), "layer_norm_epsilon": (int, float), "router_aux_loss_coef": (int, float),
    "rope_theta": (int, float), "partial_rotary_factor": (int, float), "norm_topk_prob": bool,
    "hidden_activation": str, "rope_local_base_freq": (int, float), "query_pre_attn_scalar": (int, float),
    "final_logit_softcapping": (int, float), "attn_logit_softcapping": (int, float),
    "swiglu_limit": (int, float), "swiglu_alpha": (int, float),
}
"""The JSON type of each key read; every other key is an integer."""


def _get(hf: dict[str, Any], key: str, file: Path, default: Any = _REQUIRED) -> Any:
    if key in hf and hf[key] is not None:
        value, kind = hf[key], _KINDS.get(key, int)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            names = {str: "a string", bool: "true or false", int: "an integer"}
            raise ConfigError(f"{file}: {key}={value!r}: must be {names.get(kind, 'a number')} (model.preset)")
        if kind is int and value < 1:
            raise ConfigError(f"{file}: {key}={value!r}: must be a positive integer (model.preset)")
        return value
    if default is _REQUIRED:
        raise ConfigError(f"{file}: key {key!r} is missing; add it (model_type={hf.get('model_type')!r} "
                          "needs it) or use a complete config.json")
    return default


def _unsupported(file: Path, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{file}: {key}={value!r}: {why}")


def model_fields_from_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelConfig field values for an HF config.json (or a folder containing one)."""
    hf, file = _read_json(path)
    return model_fields_of_hf(hf, file)


def model_fields_of_hf(hf: dict[str, Any], file: Path = Path("config.json")) -> dict[str, Any]:
    """ModelConfig field values for a parsed HF config.json; `file` names it in the errors."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise _unsupported(file, "model_type", model_type, f"not supported; supported: "
                           f"{', '.join(SUPPORTED_TYPES)} (or set model.preset='' and give the dimensions)")
    if model_type in WRAPPED_TYPES:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise _unsupported(file, "text_config", text, f"model_type {model_type} is supported with its text "
                               "model's config here (an object)")
        if hf.get("vision_config") is not None:
            warnings.warn(f"{file}: model_type {model_type}: its text model only is trained and estimated; "
                          "the vision tower (vision_config) and its projector are not", stacklevel=3)
        if text.get("final_logit_softcapping"):  # the multimodal class never applies it (its causal LM does)
            warnings.warn(f"{file}: text_config.final_logit_softcapping={text['final_logit_softcapping']!r} is "
                          f"ignored, as transformers' {model_type} model ignores it", stacklevel=3)
        model_type, hf = WRAPPED_TYPES[model_type], {**text, "model_type": WRAPPED_TYPES[model_type],
                                                     "final_logit_softcapping": None}
    return _gpt2_fields(hf, file) if model_type == "gpt2" else _llama_fields(hf, file, model_type)


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""HF's hidden_act (Gemma's hidden_activation) of a gated MLP -> model.mlp_activation."""


def _llama_fields(hf: dict[str, Any], file: Path, model_type: str) -> dict[str, Any]:
    kind = LLAMA_LIKE_TYPES[model_type]
    hf = {**dict(kind.defaults), **hf}
    dim, num_heads = _get(hf, "hidden_size", file), _get(hf, "num_attention_heads", file)
    head_dim = _get(hf, "head_dim", file, kind.head_dim or dim // num_heads)
    act_key = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    activation = _get(hf, act_key, file, "silu")
    if activation not in ACTIVATIONS:
        raise _unsupported(file, act_key, activation, f"supported: {', '.join(ACTIVATIONS)} (a gated MLP)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (kind.gpt_oss and key == "attention_bias"):
            raise _unsupported(file, key, hf[key], "biases on o_proj/MLP are not supported (Qwen2-style "
                               "q/k/v biases are: model_type qwen2)")
    if _get(hf, "partial_rotary_factor", file, 1.0) != 1.0:
        raise _unsupported(file, "partial_rotary_factor", hf["partial_rotary_factor"],
                           "only RoPE over the whole head (1.0) is supported")
    fields: dict[str, Any] = dict(
        family="llama", dim=dim, num_layers=_get(hf, "num_hidden_layers", file), num_heads=num_heads,
        num_kv_heads=_get(hf, "num_key_value_heads", file, num_heads),
        head_dim=0 if head_dim * num_heads == dim else head_dim,
        ffn_dim=_get(hf, "intermediate_size", file), vocab_size=_get(hf, "vocab_size", file),
        max_seq_len=_get(hf, "max_position_embeddings", file),
        norm_eps=float(_get(hf, "rms_norm_eps", file, kind.eps)),
        rope_theta=_rope_theta(hf, file, kind.theta), **({} if kind.gemma else _rope_scaling(hf, file)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", file, False)),
        qkv_bias=kind.qkv_bias, qk_norm=kind.qk_norm, norm_placement=kind.norm_placement,
        sliding_window=_sliding_window(hf, file, model_type), mlp_activation=ACTIVATIONS[activation],
        num_experts=0, num_shared_experts=0, hf_model_type=model_type,
    )
    if kind.gemma:
        fields.update(_gemma_fields(hf, file, fields, kind))
    if kind.experts == "mixtral":
        fields.update(num_experts=_get(hf, "num_local_experts", file),
                      experts_per_token=_get(hf, "num_experts_per_tok", file),
                      expert_ffn_dim=fields["ffn_dim"],
                      router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.001)))
    if kind.experts == "qwen3_moe":
        fields.update(_qwen3_moe_fields(hf, file))
    if kind.gpt_oss:
        fields.update(_gpt_oss_fields(hf, file, fields))
    if kind.experts == "olmoe":  # intermediate_size is each expert's width
        if hf.get("clip_qkv") is not None:
            raise _unsupported(file, "clip_qkv", hf["clip_qkv"], "not supported; only null (no clamping) is")
        fields.update(num_experts=_get(hf, "num_experts", file),
                      experts_per_token=_get(hf, "num_experts_per_tok", file), expert_ffn_dim=fields["ffn_dim"],
                      router_normalize_topk=bool(_get(hf, "norm_topk_prob", file, False)),
                      router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.01)))
    return fields


def _qwen3_moe_fields(hf: dict[str, Any], file: Path) -> dict[str, Any]:
    """Qwen3-MoE's experts: which layers are routed (decoder_sparse_step: every n-th; mlp_only_layers:
    dense, where they are the first n), top-k probabilities renormalised or not (norm_topk_prob)."""
    step = _get(hf, "decoder_sparse_step", file, 1)
    if not isinstance(step, int) or step < 1:
        raise _unsupported(file, "decoder_sparse_step", step, "must be a positive integer")
    dense = hf.get("mlp_only_layers") or []
    if list(dense) != list(range(len(dense))):
        raise _unsupported(file, "mlp_only_layers", dense,
                           "dense layers are supported as the first n layers ([0, 1, ..., n - 1]) only")
    experts = _get(hf, "num_experts", file, None) or _get(hf, "num_local_experts", file)  # hub's key, transformers 5's
    return dict(num_experts=experts, experts_per_token=_get(hf, "num_experts_per_tok", file),
                expert_ffn_dim=_get(hf, "moe_intermediate_size", file), moe_dense_layers=len(dense),
                moe_layer_step=step, router_normalize_topk=bool(_get(hf, "norm_topk_prob", file, False)),
                router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.001)))


def _gpt_oss_fields(hf: dict[str, Any], file: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's features (HfType.gpt_oss); intermediate_size is each expert's width. Its config.json's
    attention_bias says q, k, v and o alike: both or none."""
    biased = bool(hf.get("attention_bias", True))
    if not biased:
        raise _unsupported(file, "attention_bias", hf.get("attention_bias"), "gpt-oss is supported with its "
                           "biased attention projections (true)")
    experts = _get(hf, "num_local_experts", file)
    top_k = _get(hf, "num_experts_per_tok", file, None) or _get(hf, "experts_per_token", file)
    return dict(norm_fp32_gain=True, attention_out_bias=True, attention_sinks=True, router_bias=True, expert_bias=True,
                num_experts=experts, experts_per_token=top_k, expert_ffn_dim=fields["ffn_dim"],
                swiglu_limit=float(_get(hf, "swiglu_limit", file, 7.0)),
                swiglu_alpha=float(_get(hf, "swiglu_alpha", file, 1.702)),
                sliding_window_pattern=_layer_pattern(hf, file) if fields["sliding_window"] else 0,
                router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.001)))


def _gemma_fields(hf: dict[str, Any], file: Path, fields: dict[str, Any], kind: HfType) -> dict[str, Any]:
    """Gemma's features: (1 + w) norms, sqrt(dim)-scaled embeddings, the query scale, which layers are
    windowed (sliding_window_pattern, or transformers 5's layer_types); Gemma 2's soft-capped scores and
    logits (Gemma 3: the logits'); Gemma 3's RoPE base of the windowed layers (rope_local_base_freq, or
    rope_parameters.sliding_attention) and RoPE scaling on the global ones. Gemma 3's
    attn_logit_softcapping is read by neither transformers' Gemma 3 nor trainfit."""
    if hf.get("use_bidirectional_attention"):
        raise _unsupported(file, "use_bidirectional_attention", hf["use_bidirectional_attention"],
                           "not supported; only null/false (causal attention) is")
    out: dict[str, Any] = dict(norm_offset=True, embedding_scale=True,
                               query_pre_attn_scalar=float(_get(hf, "query_pre_attn_scalar", file)),
                               sliding_window_pattern=_layer_pattern(hf, file), rope_scaling_type="llama3")
    out.update(final_softcap=float(_get(hf, "final_logit_softcapping", file, 0.0)))
    if kind.softcaps:
        out.update(attention_softcap=float(_get(hf, "attn_logit_softcapping", file, 0.0)))
    if not kind.local_rope:  # one RoPE for every layer, read as the llama family's
        if not fields["sliding_window"]:
            out.update(sliding_window_pattern=0)
        return {**out, **_rope_scaling(hf, file)}
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one entry per layer kind
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        for where, entry in (("full_attention", full), ("sliding_attention", local)):
            if not isinstance(entry, dict):
                raise _unsupported(file, f"rope_parameters.{where}", entry, "expected an object")
        if local.get("rope_type", "default") != "default":
            raise _unsupported(file, "rope_parameters.sliding_attention.rope_type", local["rope_type"],
                               "only default RoPE on the windowed layers is supported")
        theta, local_theta, scaling = full.get("rope_theta"), local.get("rope_theta"), full
    else:
        theta, local_theta = hf.get("rope_theta"), hf.get("rope_local_base_freq")
        scaling = hf.get("rope_scaling") or {}
    out.update(rope_theta=float(theta or 1e6), rope_local_theta=float(local_theta or 1e4))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind == "linear":
        factor = scaling.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
            raise _unsupported(file, "rope_scaling.factor", factor, "rope_type linear needs a factor >= 1")
        out.update(rope_scaling_factor=float(factor), rope_scaling_type="linear")
    elif kind != "default":
        raise _unsupported(file, "rope_scaling.rope_type", kind, "Gemma 3 is supported with default or linear RoPE")
    else:
        out.update(rope_scaling_factor=0.0)
    if not fields["sliding_window"]:
        out.update(sliding_window_pattern=0)
    return out


def _layer_pattern(hf: dict[str, Any], file: Path) -> int:
    """model.sliding_window_pattern from transformers 5's layer_types (every n-th layer full_attention, the
    others sliding_attention) or the hub's sliding_window_pattern."""
    types = hf.get("layer_types")
    if types is None:
        return _get(hf, "sliding_window_pattern", file)
    if not isinstance(types, list) or not types or any(t not in ("sliding_attention", "full_attention")
                                                       for t in types):
        raise _unsupported(file, "layer_types", types, "expected a list of sliding_attention / full_attention")
    for n in range(1, len(types) + 2):
        if types == ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(len(types))]:
            return n if n <= len(types) else 0
    raise _unsupported(file, "layer_types", types, "only every n-th layer full_attention (the others "
                       "sliding_attention) is supported")


def _rope_theta(hf: dict[str, Any], file: Path, default: float) -> float:
    params = hf.get("rope_parameters")  # transformers >= 5 writes RoPE settings here
    theta = _get(hf, "rope_theta", file, None)
    if theta is None and isinstance(params, dict):
        theta = _get(params, "rope_theta", file, None)
    return float(theta or default)


LLAMA3_ROPE_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
                    "high_freq_factor": "rope_high_freq_factor",
                    "original_max_position_embeddings": "rope_original_max_seq_len"}
"""HF's rope_type "llama3" settings -> ModelConfig fields."""


def _rope_scaling(hf: dict[str, Any], file: Path) -> dict[str, Any]:
    """ModelConfig's RoPE-scaling fields from `rope_scaling` (transformers < 5) or
    `rope_parameters` (>= 5): plain RoPE, or Llama 3.1's ("llama3")."""
    where = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    scaling = hf.get(where) or {}
    if not isinstance(scaling, dict):
        raise _unsupported(file, where, scaling, "expected an object such as {\"rope_type\": \"llama3\", ...} or null")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_scaling_factor": 0.0}
    if kind == "yarn":
        return _yarn_fields(hf, scaling, where, file)
    if kind != "llama3":
        raise _unsupported(file, f"{where}.rope_type", kind, "only plain RoPE, Llama 3.1's scaling (llama3) and "
                           "YaRN (yarn) are supported")
    fields = {}
    for key, name in LLAMA3_ROPE_KEYS.items():
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _unsupported(file, f"{where}.{key}", value, "rope_type llama3 is supported with a number here")
        fields[name] = int(value) if name == "rope_original_max_seq_len" else float(value)
    return fields


def _yarn_fields(hf: dict[str, Any], scaling: dict[str, Any], where: str, file: Path) -> dict[str, Any]:
    """YaRN's settings (models/rope_scaling.py), read as transformers reads them: beta_fast and beta_slow
    default (32, 1) when absent or 0, the original context to max_position_embeddings, truncate to true."""
    def number(key: str, default: float | None) -> float | None:
        value = scaling.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _unsupported(file, f"{where}.{key}", value, "rope_type yarn is supported with a number here")
        return float(value)
    factor = number("factor", None)
    if factor is None:
        raise _unsupported(file, f"{where}.factor", None, "rope_type yarn is supported with its factor given")
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _unsupported(file, f"{where}.truncate", truncate, "rope_type yarn is supported with true or false here")
    original = number("original_max_position_embeddings", float(_get(hf, "max_position_embeddings", file)))
    return {"rope_scaling_factor": factor, "rope_scaling_type": "yarn", "rope_original_max_seq_len": int(original),
            "rope_yarn_beta_fast": number("beta_fast", None) or 32.0,
            "rope_yarn_beta_slow": number("beta_slow", None) or 1.0, "rope_yarn_truncate": truncate,
            "rope_yarn_mscale": number("mscale", 0.0), "rope_yarn_mscale_all_dim": number("mscale_all_dim", 0.0),
            "rope_attention_factor": number("attention_factor", 0.0)}


def _sliding_window(hf: dict[str, Any], file: Path, model_type: str) -> int:
    """model.sliding_window: the config's window where every layer has it (Mistral, Mixtral, Phi-3),
    0 when it spans the context. Qwen2/3's (use_sliding_window, from layer max_window_layers on) is
    not every layer's: ignored with a warning."""
    window = hf.get("sliding_window")
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    if qwen and not hf.get("use_sliding_window"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise _unsupported(file, "sliding_window", window, "must be an integer or null")
    if window is None or window >= _get(hf, "max_position_embeddings", file):
        return 0
    if qwen:
        warnings.warn(f"{file}: sliding_window={window} is ignored (full causal attention); logits "
                      f"differ from the original model beyond {window} tokens", stacklevel=4)
        return 0
    return window


def _gpt2_fields(hf: dict[str, Any], file: Path) -> dict[str, Any]:
    if _get(hf, "activation_function", file, "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _unsupported(file, "activation_function", hf["activation_function"],
                           "only gelu_new is supported")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(key):
            raise _unsupported(file, key, hf[key], "not supported; set it to false")
    dim = _get(hf, "n_embd", file)
    return dict(family="gpt2", dim=dim, num_layers=_get(hf, "n_layer", file),
                num_heads=_get(hf, "n_head", file), ffn_dim=_get(hf, "n_inner", file, 4 * dim),
                vocab_size=_get(hf, "vocab_size", file), max_seq_len=_get(hf, "n_positions", file),
                norm_eps=float(_get(hf, "layer_norm_epsilon", file, 1e-5)),
                tie_embeddings=bool(_get(hf, "tie_word_embeddings", file, True)), num_experts=0)


def hf_config_dict(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """A config.json that transformers loads for `cfg`: as model.hf_model_type when set (the type it
    was read from), else the simplest llama-family type with its features (llama, qwen2 when qkv_bias,
    qwen3 with QK-norm, mixtral or qwen3_moe with experts), or gpt2."""
    return _schema(cfg).config(cfg, dtype)


def _gpt2_config_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.dim,
                n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.ffn_dim,
                vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)


def _llama_config_dict(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    model_type = _llama_model_type(cfg)
    kind = LLAMA_LIKE_TYPES[model_type]
    out = dict(architectures=[kind.architecture], model_type=model_type, hidden_size=cfg.dim,
               intermediate_size=cfg.expert_ffn_dim if kind.experts == "mixtral" else cfg.ffn_dim,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=describe(cfg).attention.head_dim,
               vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, rope_scaling=_hf_rope_scaling(cfg),
               hidden_act={v: k for k, v in ACTIVATIONS.items()}[cfg.mlp_activation],
               tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
    if kind.gemma:  # transformers 5's schema: each layer's kind listed (Gemma 3: RoPE per kind)
        windowed = [la.attention.window != 0 for la in describe(cfg).layers]
        scalar = cfg.query_pre_attn_scalar or describe(cfg).attention.head_dim
        out.update(hidden_activation=out.pop("hidden_act"), sliding_window=cfg.sliding_window or None,
                   query_pre_attn_scalar=int(scalar) if scalar == int(scalar) else scalar,  # transformers: an int
                   layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
                   final_logit_softcapping=cfg.final_softcap or None, attn_logit_softcapping=cfg.attention_softcap
                   or None, pad_token_id=None)
    if kind.local_rope:
        del out["rope_theta"], out["rope_scaling"]
        full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling_factor:
            full.update(rope_type="linear", factor=cfg.rope_scaling_factor)
        out.update(rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}})
    if kind.experts == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if kind.experts == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_ffn_dim, norm_topk_prob=bool(cfg.router_normalize_topk),
                   decoder_sparse_step=cfg.moe_layer_step, mlp_only_layers=list(range(cfg.moe_dense_layers)),
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if kind.experts == "olmoe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   intermediate_size=cfg.expert_ffn_dim, norm_topk_prob=bool(cfg.router_normalize_topk),
                   router_aux_loss_coef=cfg.router_aux_loss_coef, clip_qkv=None)
    if kind.gpt_oss:
        windowed = [la.attention.window != 0 for la in describe(cfg).layers]
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   intermediate_size=cfg.expert_ffn_dim, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                   attention_bias=True, router_aux_loss_coef=cfg.router_aux_loss_coef,
                   layer_types=["sliding_attention" if w else "full_attention" for w in windowed],
                   sliding_window=cfg.sliding_window or None, pad_token_id=None, eos_token_id=None)
        # transformers 5 reads RoPE from rope_parameters, where GptOssConfig's default is YaRN: written out
        del out["rope_theta"], out["rope_scaling"]
        rope = _hf_rope_scaling(cfg) or {"rope_type": "default"}
        out.update(rope_parameters={**rope, "rope_theta": cfg.rope_theta})
    if kind.window and not kind.gemma and not kind.gpt_oss:  # Gemma's and gpt-oss's with their layer kinds above
        out.update(sliding_window=cfg.sliding_window or None)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False)
    if model_type == "phi3":  # its defaults' pad id (32000) would lie outside a smaller vocabulary
        out.update(original_max_position_embeddings=cfg.max_seq_len, pad_token_id=None)
    return out


def _hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    if not cfg.rope_scaling_factor:
        return None
    if cfg.rope_scaling_type == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling_type == "yarn":
        optional = {"mscale": cfg.rope_yarn_mscale, "mscale_all_dim": cfg.rope_yarn_mscale_all_dim,
                    "attention_factor": cfg.rope_attention_factor}
        return {"rope_type": "yarn", "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len,
                "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
                "truncate": bool(cfg.rope_yarn_truncate), **{k: v for k, v in optional.items() if v}}
    return {"rope_type": "llama3", **{key: getattr(cfg, name) for key, name in LLAMA3_ROPE_KEYS.items()}}


GPT_OSS_FEATURES = ("attention_sinks", "attention_out_bias", "router_bias", "expert_bias", "swiglu_limit")
"""What only a gpt_oss checkpoint holds, all together: one of them set makes the model that type's or none."""


def _llama_model_type(cfg: ModelConfig) -> str:
    """The llama-family model_type `cfg` is written as (hf_config_dict), checked against its features."""
    gpt_oss_set = [name for name in GPT_OSS_FEATURES if getattr(cfg, name)]
    gpt_oss = bool(gpt_oss_set)
    experts = "" if not cfg.num_experts else "gpt_oss" if gpt_oss else \
        {"head": "qwen3_moe", "whole": "olmoe"}.get(cfg.qk_norm, "mixtral")
    gemma = cfg.norm_placement == "sandwich" or bool(cfg.norm_offset or cfg.embedding_scale)
    model_type = cfg.hf_model_type or (experts if experts else
                                       ("gemma2" if cfg.qk_norm == "none" else "gemma3_text") if gemma else
                                       "olmo2" if cfg.norm_placement == "post" else
                                       "qwen3" if cfg.qk_norm == "head" else "qwen2" if cfg.qkv_bias else
                                       "mistral" if cfg.sliding_window else "llama")
    kind = LLAMA_LIKE_TYPES.get(model_type)
    if kind is None:
        raise ConfigError(f"model.hf_model_type={model_type!r}: not a llama-family type; choose one of "
                          f"{', '.join(LLAMA_TYPES)} or '' (chosen from the model's features)")
    features = dict(qkv_bias=bool(cfg.qkv_bias), qk_norm=cfg.qk_norm, norm_placement=cfg.norm_placement,
                    experts=experts, gemma=gemma, gpt_oss=gpt_oss)
    if gpt_oss and len(gpt_oss_set) < len(GPT_OSS_FEATURES):
        off = [name for name in GPT_OSS_FEATURES if name not in gpt_oss_set]
        raise ConfigError(f"model.{off[0]}={getattr(cfg, off[0])!r}: a gpt_oss checkpoint has attention sinks, "
                          "biased o_proj, router and experts and the clamped SwiGLU together; set all of them, or "
                          "none")
    held = {"query_pre_attn_scalar": (0.0, kind.gemma),
            "sliding_window_pattern": (0, kind.gemma or kind.gpt_oss),
            "rope_local_theta": (0.0, kind.local_rope), "rope_scaling_type": ("llama3", kind.local_rope),
            "attention_softcap": (0.0, kind.softcaps), "final_softcap": (0.0, kind.gemma),
            "norm_fp32_gain": (False, kind.gpt_oss)}
    for name, (plain, holds) in held.items():  # what only some types' config.json can say
        scaling = name != "rope_scaling_type" or cfg.rope_scaling_factor and cfg.rope_scaling_type == "linear"
        if not holds and getattr(cfg, name) != plain and scaling:
            raise ConfigError(f"model.{name}={getattr(cfg, name)!r}: model.hf_model_type={model_type!r} cannot "
                              f"hold it; set it to {plain!r}, or model.hf_model_type to a type that has it "
                              "(gemma2: soft-capping; gemma3_text: a RoPE base of the windowed layers)")
    if cfg.rope_scaling_factor and cfg.rope_scaling_type == "yarn" and kind.gemma:
        raise ConfigError(f"model.rope_scaling_type='yarn': model.hf_model_type={model_type!r} cannot hold it; set "
                          "model.hf_model_type to a llama-family type without Gemma's features, or another scaling")
    if cfg.sliding_window:
        features["window"] = True  # a type whose config.json says its layers' window
    for name, value in features.items():
        theirs = getattr(kind, name, False)
        if theirs != value:
            raise ConfigError(f"model.hf_model_type={model_type!r} has {name}={theirs!r}, the model {value!r}: "
                              f"no {', '.join(SUPPORTED_TYPES)} checkpoint holds this model; set "
                              "model.hf_model_type='' to pick one from its features, if one has them")
    if cfg.num_shared_experts:
        raise ConfigError(f"model.num_shared_experts={cfg.num_shared_experts}: shared experts have no equivalent "
                          f"among the supported HF types ({', '.join(SUPPORTED_TYPES)})")
    if (cfg.moe_dense_layers or cfg.moe_layer_step > 1) and kind.experts != "qwen3_moe":
        field, value = ("moe_dense_layers", cfg.moe_dense_layers) if cfg.moe_dense_layers else \
            ("moe_layer_step", cfg.moe_layer_step)
        raise ConfigError(f"model.{field}={value}: model.hf_model_type={model_type!r} has MoE in every layer; "
                          "set it to its default, or use qwen3_moe (mlp_only_layers, decoder_sparse_step)")
    if cfg.num_experts and not cfg.router_normalize_topk and kind.experts == "mixtral":
        raise ConfigError(f"model.router_normalize_topk=False: model.hf_model_type={model_type!r} always "
                          "renormalises the top-k routing weights; set it to true, or use qwen3_moe or olmoe")
    return model_type


# ---------------------------------------------------------------- weight name groups


def _same(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return tensors


def _transposed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF GPT-2 Conv1D stores [in, out]; our Linear stores [out, in]."""
    return [t.t().contiguous() for t in tensors]


@dataclass
class _Group:
    """Our parameters `ours` <-> checkpoint tensors `theirs`, converted by to_ours / to_theirs."""

    ours: list[str]
    theirs: list[str]
    to_ours: Callable[[list[torch.Tensor]], list[torch.Tensor]] = _same
    to_theirs: Callable[[list[torch.Tensor]], list[torch.Tensor]] = _same


def _pairs(ours: str, theirs: str, mapping: dict[str, str]) -> list[_Group]:
    return [_Group([ours + a], [theirs + b]) for a, b in mapping.items()]


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> the HF checkpoint's, for the parameters stored one to one (not GPT-2's
    fused attention, not Mixtral's stacked experts): what adapters' exports name their modules by."""
    return {g.ours[0]: g.theirs[0] for g in _groups(cfg) if len(g.ours) == len(g.theirs) == 1
            and g.to_ours is _same}


def _groups(cfg: ModelConfig) -> list[_Group]:
    return _schema(cfg).groups(cfg)


def _llama_groups(cfg: ModelConfig) -> list[_Group]:
    import torch

    kind, a = LLAMA_LIKE_TYPES[_llama_model_type(cfg)], describe(cfg).attention
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        top["output.weight"] = "lm_head.weight"
    groups = _pairs("", "", top)
    proj = ("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj")
    stacked = dict(to_ours=lambda ts: [torch.stack(ts)],
                   to_theirs=lambda ts: [t.clone() for t in ts[0].unbind(0)])  # unshared storage
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        layer = {"attention.wo.weight": "self_attn.o_proj.weight"}
        if cfg.norm_placement == "post":  # OLMo 2: a norm after each branch, none before
            layer.update({"attention_post_norm.weight": "post_attention_layernorm.weight",
                          "ffn_post_norm.weight": "post_feedforward_layernorm.weight"})
        elif cfg.norm_placement == "sandwich":  # Gemma: one before and one after each branch
            layer.update({"attention_norm.weight": "input_layernorm.weight",
                          "attention_post_norm.weight": "post_attention_layernorm.weight",
                          "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                          "ffn_post_norm.weight": "post_feedforward_layernorm.weight"})
        else:
            layer.update({"attention_norm.weight": "input_layernorm.weight",
                          "ffn_norm.weight": "post_attention_layernorm.weight"})
        if kind.fused:
            groups += [_fused(f"{ours}attention.", (("wq", a.q_dim), ("wk", a.kv_dim), ("wv", a.kv_dim)),
                              f"{theirs}self_attn.qkv_proj.weight")]
        else:
            layer.update({f"attention.{a}.weight": f"self_attn.{b}.weight" for a, b in proj})
        if cfg.qkv_bias:
            layer.update({f"attention.{a}.bias": f"self_attn.{b}.bias" for a, b in proj})
        if cfg.qk_norm != "none":
            layer.update({"attention.q_norm.weight": "self_attn.q_norm.weight",
                          "attention.k_norm.weight": "self_attn.k_norm.weight"})
        if kind.gpt_oss:
            layer.update({"attention.wo.bias": "self_attn.o_proj.bias", "attention.sinks": "self_attn.sinks",
                          "feed_forward.router.weight": "mlp.router.weight",
                          "feed_forward.router.bias": "mlp.router.bias"})
            groups += _gpt_oss_experts(f"{ours}feed_forward.experts.", f"{theirs}mlp.experts.")
        elif kind.experts and moe_layer(cfg, i):
            moe, names = (("block_sparse_moe", ("w1", "w2", "w3")) if kind.experts == "mixtral" else
                          ("mlp", ("gate_proj", "down_proj", "up_proj")))
            layer["feed_forward.router.weight"] = f"{moe}.gate.weight"
            groups += [_Group([f"{ours}feed_forward.experts.{w}"],
                              [f"{theirs}{moe}.experts.{e}.{name}.weight" for e in range(cfg.num_experts)], **stacked)
                       for w, name in zip(("w1", "w2", "w3"), names, strict=True)]
        elif kind.fused:
            layer["feed_forward.w2.weight"] = "mlp.down_proj.weight"
            groups += [_fused(f"{ours}feed_forward.", (("w1", cfg.ffn_dim), ("w3", cfg.ffn_dim)),
                              f"{theirs}mlp.gate_up_proj.weight")]
        else:
            layer.update({"feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight":
                          "mlp.down_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight"})
        groups += _pairs(ours, theirs, layer)
    return groups


def _gpt_oss_experts(ours: str, theirs: str) -> list[_Group]:
    """gpt-oss's stacked experts: gate_up_proj [E, dim, 2F] (gate and up interleaved along its last dim: gate at
    even columns) and its bias [E, 2F] -> w1, w3 [E, F, dim] and their biases; down_proj [E, F, dim] -> w2 [E,
    dim, F]; down_proj_bias is w2's."""
    import torch

    def split(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        gate_up, bias = ts
        return [gate_up[..., ::2].transpose(1, 2).contiguous(), gate_up[..., 1::2].transpose(1, 2).contiguous(),
                bias[..., ::2].contiguous(), bias[..., 1::2].contiguous()]

    def interleave(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        w1, w3, b1, b3 = ts
        gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=-1).flatten(-2)
        return [gate_up.contiguous(), torch.stack([b1, b3], dim=-1).flatten(-2).contiguous()]

    def transposed(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [ts[0].transpose(1, 2).contiguous()]
    return [_Group([f"{ours}w1", f"{ours}w3", f"{ours}w1_bias", f"{ours}w3_bias"],
                   [f"{theirs}gate_up_proj", f"{theirs}gate_up_proj_bias"], split, interleave),
            _Group([f"{ours}w2"], [f"{theirs}down_proj"], transposed, transposed),
            _Group([f"{ours}w2_bias"], [f"{theirs}down_proj_bias"])]


def _fused(ours: str, linears: tuple[tuple[str, int], ...], theirs: str) -> _Group:
    """Linears stored as one weight, their output rows one after the other (Phi-3's qkv_proj, gate_up_proj):
    `linears` are (name, output rows) in that order."""
    import torch

    rows = [n for _, n in linears]
    return _Group([f"{ours}{w}.weight" for w, _ in linears], [theirs],
                  to_ours=lambda ts: list(ts[0].split(rows, dim=0)), to_theirs=lambda ts: [torch.cat(ts, dim=0)])


def _gpt2_groups(cfg: ModelConfig) -> list[_Group]:
    """Names without the "transformer." prefix (hub files omit it; save_pretrained writes it)."""
    import torch

    top = {"tok_embeddings.weight": "wte.weight", "pos_embeddings.weight": "wpe.weight",
           "norm.weight": "ln_f.weight", "norm.bias": "ln_f.bias"}
    groups = _pairs("", "", top)
    if not cfg.tie_embeddings:
        groups.append(_Group(["output.weight"], ["lm_head.weight"]))
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"h.{i}."
        groups += _pairs(ours, theirs, {
            "attention_norm.weight": "ln_1.weight", "attention_norm.bias": "ln_1.bias",
            "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
            "attention.wo.bias": "attn.c_proj.bias", "feed_forward.w1.bias": "mlp.c_fc.bias",
            "feed_forward.w2.bias": "mlp.c_proj.bias",
        })
        for a, b in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                     ("feed_forward.w2", "mlp.c_proj")):
            groups.append(_Group([f"{ours}{a}.weight"], [f"{theirs}{b}.weight"], _transposed, _transposed))
        qkv = [f"{ours}attention.{w}" for w in ("wq", "wk", "wv")]
        groups.append(_Group([f"{n}.weight" for n in qkv], [f"{theirs}attn.c_attn.weight"],
                             to_ours=lambda ts: list(ts[0].t().chunk(3, dim=0)),
                             to_theirs=lambda ts: [torch.cat(ts, dim=0).t().contiguous()]))
        groups.append(_Group([f"{n}.bias" for n in qkv], [f"{theirs}attn.c_attn.bias"],
                             to_ours=lambda ts: list(ts[0].chunk(3, dim=0)),
                             to_theirs=lambda ts: [torch.cat(ts, dim=0)]))
    return groups


# ---------------------------------------------------------------- safetensors in and out


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no .safetensors file; give a .safetensors file or a folder holding them")
    return files


def load_hf_weights(model: nn.Module, cfg: ModelConfig, path: str | Path) -> None:
    """Copy an HF safetensors checkpoint (a file, a folder, or a sharded index) into a materialized
    model: a plain one, or this rank's part of a parallelized one (each parameter named as in the
    plain model; a sharded one keeps its own slice of the whole tensor, which every rank reads).
    Adapters (peft/: parameters named lora_*) are not the base's and keep their values."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    from trainfit.models.init import canonical_name
    from trainfit.models.nf4 import assign_nf4_, is_nf4

    params = {canonical_name(name): p for name, p in model.named_parameters(remove_duplicate=False)
              if not name.rsplit(".", 1)[-1].startswith("lora_")}
    if any(p.is_meta for p in params.values()):
        raise ValueError("load_hf_weights needs a materialized model: call model.to_empty(device=...) "
                         "and model.init_weights() first")
    theirs: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        theirs.update(load_file(file))
    prefix = _schema(cfg).prefix  # hub files omit it, save_pretrained writes it
    theirs = {name.removeprefix(prefix): t for name, t in theirs.items()}
    theirs = _text_model_tensors(theirs, path)
    theirs = _mxfp4_dequantized(theirs, path)
    groups = _groups(cfg)
    tied_output = {"output.weight"} if cfg.tie_embeddings else set()
    assert {n for g in groups for n in g.ours} | tied_output == set(params)
    used = {n for g in groups for n in g.theirs}
    missing = sorted(used - set(theirs))
    if missing:
        raise ValueError(f"{path}: {len(missing)} tensors our {cfg.family} model needs are missing, e.g. "
                         f"{missing[:3]}; does the config match this checkpoint?")
    tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()  # redundant copy of the embedding
    unused = sorted(n for n in theirs if n not in used | tied_head and not _IGNORED.search(n))
    if unused:
        raise ValueError(f"{path}: {len(unused)} checkpoint tensors have no place in our {cfg.family} model, "
                         f"e.g. {unused[:3]}; does the config match this checkpoint?")
    with torch.no_grad():
        for group in groups:
            for name, value in zip(group.ours, group.to_ours([theirs[n] for n in group.theirs]), strict=True):
                if params[name].shape != value.shape:
                    raise ValueError(f"{path}: {group.theirs[0]} gives {name} the shape "
                                     f"{tuple(value.shape)}, the model has {tuple(params[name].shape)}; "
                                     "does the config match?")
                param = params[name]
                if is_nf4(param):  # QLoRA's base: quantized whole, each rank keeping its rows
                    assign_nf4_(param, value)
                    continue
                if isinstance(param, DTensor):  # every rank holds the whole value: no communication
                    value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements,
                                              src_data_rank=None)
                param.copy_(value)


_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                         "language_model.lm_head.": "lm_head."}
"""A multimodal checkpoint's text model (Gemma 3: the hub's names, then transformers 5's) -> a causal LM's."""
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _mxfp4_dequantized(theirs: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """gpt-oss's published experts in MXFP4 (models/mxfp4.py): each NAME_blocks with its NAME_scales becomes
    NAME in bf16, as transformers builds it (exact: every FP4 value times its power of two is a bf16 value)."""
    from trainfit.models.mxfp4 import hf_expert_weight

    for name in [n for n in theirs if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        scales = theirs.pop(f"{base}_scales", None)
        if scales is None:
            raise ValueError(f"{path}: {name} has no {base}_scales beside it; an MXFP4 tensor needs both")
        theirs[base] = hf_expert_weight(theirs.pop(name), scales)
    return theirs


def _text_model_tensors(theirs: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """The text model's tensors of a multimodal checkpoint under a causal LM's names, the vision tower's
    left out with a warning that counts them (a causal LM's checkpoint passes unchanged)."""
    vision = [name for name in theirs if name.startswith(_VISION_PREFIXES)]
    if not vision and not any(name.startswith(tuple(_TEXT_MODEL_PREFIXES)) for name in theirs):
        return theirs
    if vision:
        warnings.warn(f"{path}: {len(vision)} tensors of the vision tower and its projector (e.g. {vision[0]}) "
                      "are not loaded: the text model alone is trained", stacklevel=3)
    out = {}
    for name, tensor in theirs.items():
        if name in vision:
            continue
        prefix = next((p for p in _TEXT_MODEL_PREFIXES if name.startswith(p)), "")
        out[(_TEXT_MODEL_PREFIXES[prefix] + name[len(prefix):]) if prefix else name] = tensor
    return out


def save_hf_weights(model: nn.Module, cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write model.safetensors and config.json so transformers' from_pretrained(out_dir) loads the model."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)
              if not name.rsplit(".", 1)[-1].startswith("lora_")}  # adapters: merged in first, or exported apart
    prefix = _schema(cfg).prefix  # what from_pretrained's class names its body
    tensors = {}
    for group in _groups(cfg):
        values = group.to_theirs([params[n].detach() for n in group.ours])
        tensors.update({prefix + n: t.contiguous() for n, t in zip(group.theirs, values, strict=True)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    dtype = str(params["tok_embeddings.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")


@dataclass(frozen=True)
class _Schema:
    """How a module tree's config and weights are written in a checkpoint."""

    config: Callable[[ModelConfig, str], dict[str, Any]]
    """config.json for the model (and the dtype its weights are saved in)."""
    groups: Callable[[ModelConfig], list[_Group]]
    """Our parameters and the checkpoint's tensors they are."""
    prefix: str = ""
    """What from_pretrained's class puts before the body's tensor names."""


_SCHEMAS = {
    "llama": _Schema(_llama_config_dict, _llama_groups),
    # GPT-2's config.json (n_embd, n_layer, ...) and checkpoint (Conv1D's [in, out], one c_attn, the
    # "transformer." body) are schemas of their own
    "gpt2": _Schema(_gpt2_config_dict, _gpt2_groups, prefix="transformer."),
}


def _schema(cfg: ModelConfig) -> _Schema:
    """The checkpoint schema of the module tree model.family picks (models/__init__.build_model)."""
    return _SCHEMAS[cfg.family]
