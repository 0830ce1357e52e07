"""Hugging Face interop: config.json -> ModelConfig fields (torch-free), safetensors weights in and out.

Supported `model_type`s: llama, mistral, mixtral, qwen2 (family llama) and gpt2. Weight names are
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
from trainfit.models.architecture import describe

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
    """How routed experts are configured and named: "" none, "mixtral" or "qwen3_moe"."""
    fused: bool = False
    """Phi-3: q, k, v stored as one qkv_proj, gate and up as one gate_up_proj."""


LLAMA_LIKE_TYPES = {
    "llama": HfType("LlamaForCausalLM"),
    "mistral": HfType("MistralForCausalLM"),
    "mixtral": HfType("MixtralForCausalLM", eps=1e-5, theta=1e6, experts="mixtral"),
    "qwen2": HfType("Qwen2ForCausalLM", qkv_bias=True),
    "qwen3": HfType("Qwen3ForCausalLM", head_dim=128, qk_norm="head"),
    "qwen3_moe": HfType("Qwen3MoeForCausalLM", head_dim=128, qk_norm="head", experts="qwen3_moe"),
    "olmo2": HfType("Olmo2ForCausalLM", eps=1e-5, qk_norm="whole", norm_placement="post"),
    "phi3": HfType("Phi3ForCausalLM", eps=1e-5, fused=True),
}
"""The llama-family model types, each a mapping from its config.json (_llama_fields) and its weight
names (_llama_groups); a new one is an entry here when its features are the architecture's."""
LLAMA_TYPES = tuple(LLAMA_LIKE_TYPES)
SUPPORTED_TYPES = (*LLAMA_TYPES, "gpt2")
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
    return _gpt2_fields(hf, file) if model_type == "gpt2" else _llama_fields(hf, file, model_type)


def _llama_fields(hf: dict[str, Any], file: Path, model_type: str) -> dict[str, Any]:
    kind = LLAMA_LIKE_TYPES[model_type]
    dim, num_heads = _get(hf, "hidden_size", file), _get(hf, "num_attention_heads", file)
    head_dim = _get(hf, "head_dim", file, kind.head_dim or dim // num_heads)
    if _get(hf, "hidden_act", file, "silu") != "silu":
        raise _unsupported(file, "hidden_act", hf["hidden_act"], "only silu (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
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
        rope_theta=_rope_theta(hf, file, kind.theta), **_rope_scaling(hf, file),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", file, False)),
        qkv_bias=kind.qkv_bias, qk_norm=kind.qk_norm, norm_placement=kind.norm_placement,
        sliding_window=_sliding_window(hf, file, model_type),
        num_experts=0, num_shared_experts=0, hf_model_type=model_type,
    )
    if kind.experts == "mixtral":
        fields.update(num_experts=_get(hf, "num_local_experts", file),
                      experts_per_token=_get(hf, "num_experts_per_tok", file),
                      expert_ffn_dim=fields["ffn_dim"],
                      router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.001)))
    if kind.experts == "qwen3_moe":
        fields.update(_qwen3_moe_fields(hf, file))
    return fields


def _qwen3_moe_fields(hf: dict[str, Any], file: Path) -> dict[str, Any]:
    """Qwen3-MoE's experts: every layer routed (decoder_sparse_step 1, no mlp_only_layers), top-k
    probabilities renormalised (norm_topk_prob, as our MoE and Mixtral do)."""
    if _get(hf, "decoder_sparse_step", file, 1) != 1:
        raise _unsupported(file, "decoder_sparse_step", hf["decoder_sparse_step"],
                           "only 1 (every layer MoE) is supported")
    if hf.get("mlp_only_layers"):
        raise _unsupported(file, "mlp_only_layers", hf["mlp_only_layers"],
                           "dense layers among MoE ones are not supported yet; only [] is")
    if not _get(hf, "norm_topk_prob", file, False):
        raise _unsupported(file, "norm_topk_prob", hf.get("norm_topk_prob", False),
                           "only true (the top-k routing weights renormalised to sum to 1) is supported")
    experts = _get(hf, "num_experts", file, None) or _get(hf, "num_local_experts", file)  # hub's key, transformers 5's
    return dict(num_experts=experts, experts_per_token=_get(hf, "num_experts_per_tok", file),
                expert_ffn_dim=_get(hf, "moe_intermediate_size", file),
                router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", file, 0.001)))


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
    if kind != "llama3":
        raise _unsupported(file, f"{where}.rope_type", kind, "only plain RoPE and Llama 3.1's scaling (llama3) are "
                           "supported")
    fields = {}
    for key, name in LLAMA3_ROPE_KEYS.items():
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _unsupported(file, f"{where}.{key}", value, "rope_type llama3 is supported with a number here")
        fields[name] = int(value) if name == "rope_original_max_seq_len" else float(value)
    return fields


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
    if cfg.family == "gpt2":  # GPT-2's config.json is a schema of its own (n_embd, n_layer, ...)
        return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=cfg.dim,
                    n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.ffn_dim,
                    vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
                    activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
    model_type = _llama_model_type(cfg)
    kind = LLAMA_LIKE_TYPES[model_type]
    out = dict(architectures=[kind.architecture], model_type=model_type, hidden_size=cfg.dim,
               intermediate_size=cfg.expert_ffn_dim if kind.experts == "mixtral" else cfg.ffn_dim,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=describe(cfg).block.attention.head_dim,
               vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rope_theta, rope_scaling=_hf_rope_scaling(cfg), hidden_act="silu",
               tie_word_embeddings=cfg.tie_embeddings, torch_dtype=dtype)
    if kind.experts == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   router_aux_loss_coef=cfg.router_aux_loss_coef)
    if kind.experts == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_ffn_dim, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=cfg.router_aux_loss_coef)
    if model_type in ("mistral", "mixtral", "phi3"):
        out.update(sliding_window=cfg.sliding_window or None)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out.update(use_sliding_window=False)
    if model_type == "phi3":  # its defaults' pad id (32000) would lie outside a smaller vocabulary
        out.update(original_max_position_embeddings=cfg.max_seq_len, pad_token_id=None)
    return out


def _hf_rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    if not cfg.rope_scaling_factor:
        return None
    return {"rope_type": "llama3", **{key: getattr(cfg, name) for key, name in LLAMA3_ROPE_KEYS.items()}}


def _llama_model_type(cfg: ModelConfig) -> str:
    """The llama-family model_type `cfg` is written as (hf_config_dict), checked against its features."""
    experts = "" if not cfg.num_experts else "qwen3_moe" if cfg.qk_norm == "head" else "mixtral"
    model_type = cfg.hf_model_type or ("qwen3_moe" if experts == "qwen3_moe" else "mixtral" if experts else
                                       "olmo2" if cfg.norm_placement == "post" else
                                       "qwen3" if cfg.qk_norm == "head" else "qwen2" if cfg.qkv_bias else
                                       "mistral" if cfg.sliding_window else "llama")
    kind = LLAMA_LIKE_TYPES.get(model_type)
    if kind is None:
        raise ConfigError(f"model.hf_model_type={model_type!r}: not a llama-family type; choose one of "
                          f"{', '.join(LLAMA_TYPES)} or '' (chosen from the model's features)")
    features = dict(qkv_bias=bool(cfg.qkv_bias), qk_norm=cfg.qk_norm, norm_placement=cfg.norm_placement,
                    experts=experts)
    if cfg.sliding_window and model_type not in ("mistral", "mixtral", "phi3"):
        features["window"] = True  # a type whose every layer may have one
    for name, value in features.items():
        theirs = getattr(kind, name, False)
        if theirs != value:
            raise ConfigError(f"model.hf_model_type={model_type!r} has {name}={theirs!r}, the model {value!r}: "
                              f"no {', '.join(SUPPORTED_TYPES)} checkpoint holds this model; set "
                              "model.hf_model_type='' to pick one from its features, if one has them")
    if cfg.num_shared_experts:
        raise ConfigError(f"model.num_shared_experts={cfg.num_shared_experts}: shared experts have no equivalent "
                          f"among the supported HF types ({', '.join(SUPPORTED_TYPES)})")
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
    # GPT-2's checkpoint names and lays out its weights its own way (Conv1D's [in, out], one c_attn)
    return _gpt2_groups(cfg) if cfg.family == "gpt2" else _llama_groups(cfg)


def _llama_groups(cfg: ModelConfig) -> list[_Group]:
    import torch

    kind, a = LLAMA_LIKE_TYPES[_llama_model_type(cfg)], describe(cfg).block.attention
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
        if kind.experts:
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
    if cfg.family == "gpt2":  # hub files omit GPT2LMHeadModel's "transformer." prefix, save_pretrained writes it
        theirs = {name.removeprefix("transformer."): t for name, t in theirs.items()}
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


def save_hf_weights(model: nn.Module, cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write model.safetensors and config.json so transformers' from_pretrained(out_dir) loads the model."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)
              if not name.rsplit(".", 1)[-1].startswith("lora_")}  # adapters: merged in first, or exported apart
    prefix = "transformer." if cfg.family == "gpt2" else ""  # what from_pretrained's GPT2LMHeadModel names
    tensors = {}
    for group in _groups(cfg):
        values = group.to_theirs([params[n].detach() for n in group.ours])
        tensors.update({prefix + n: t.contiguous() for n, t in zip(group.theirs, values, strict=True)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    dtype = str(params["tok_embeddings.weight"].dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype), indent=2) + "\n")
