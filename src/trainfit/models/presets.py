"""Named model sizes, and the resolution of a ModelConfig from its preset. Torch-free."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from trainfit.config.schema import ConfigError, ModelConfig

# Values every model gets when neither the preset nor the user sets them.
DEFAULTS: dict[str, Any] = {
    "family": "llama",
    "norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling_factor": 0.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_seq_len": 8192,
    "tie_embeddings": False,
    "qkv_bias": False,
    "head_dim": 0,
    "qk_norm": "none",
    "norm_placement": "pre",
    "sliding_window": 0,
    "sliding_window_pattern": 0,
    "query_pre_attn_scalar": 0.0,
    "attention_softcap": 0.0,
    "final_softcap": 0.0,
    "embedding_scale": False,
    "mlp_activation": "silu",
    "norm_offset": False,
    "rope_scaling_type": "llama3",
    "rope_local_theta": 0.0,
    "hf_model_type": "",
    "num_experts": 0,
    "experts_per_token": 2,
    "num_shared_experts": 0,
    "router_aux_loss_coef": 0.01,
    "capacity_factor": 0.0,
    "router_normalize_topk": True,
    "moe_dense_layers": 0,
    "moe_layer_step": 1,
    "norm_fp32_gain": False,
    "attention_out_bias": False,
    "attention_sinks": False,
    "router_bias": False,
    "expert_bias": False,
    "swiglu_limit": 0.0,
    "swiglu_alpha": 1.702,
    "rope_yarn_beta_fast": 32.0,
    "rope_yarn_beta_slow": 1.0,
    "rope_yarn_truncate": True,
    "rope_yarn_mscale": 0.0,
    "rope_yarn_mscale_all_dim": 0.0,
    "rope_attention_factor": 0.0,
}


def _gpt2(dim: int, num_layers: int, num_heads: int) -> dict[str, Any]:
    return dict(family="gpt2", dim=dim, num_layers=num_layers, num_heads=num_heads, ffn_dim=4 * dim,
                vocab_size=50257, max_seq_len=1024, tie_embeddings=True)


_QWEN3 = dict(vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6, qk_norm="head",
              hf_model_type="qwen3")

_GPT_OSS = dict(dim=2880, num_heads=64, num_kv_heads=8, head_dim=64, ffn_dim=2880, expert_ffn_dim=2880,
                vocab_size=201088, max_seq_len=131072, rope_theta=150000.0, rope_scaling_factor=32.0,
                rope_scaling_type="yarn", rope_original_max_seq_len=4096, rope_yarn_truncate=False, qkv_bias=True,
                norm_fp32_gain=True, attention_out_bias=True, attention_sinks=True, router_bias=True, expert_bias=True,
                swiglu_limit=7.0, experts_per_token=4, sliding_window=128, sliding_window_pattern=2,
                router_aux_loss_coef=0.9, hf_model_type="gpt_oss")
_OLMO2 = dict(vocab_size=100352, max_seq_len=4096, norm_eps=1e-6, rope_theta=5e5, qk_norm="whole",
              norm_placement="post", hf_model_type="olmo2")
_GEMMA2 = dict(vocab_size=256000, max_seq_len=8192, norm_eps=1e-6, tie_embeddings=True, norm_placement="sandwich",
               norm_offset=True, embedding_scale=True, mlp_activation="gelu_tanh", sliding_window=4096,
               sliding_window_pattern=2, attention_softcap=50.0, final_softcap=30.0, hf_model_type="gemma2")
_GEMMA3 = dict(head_dim=256, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4, tie_embeddings=True, qk_norm="head",
               norm_placement="sandwich", norm_offset=True, embedding_scale=True, mlp_activation="gelu_tanh",
               sliding_window_pattern=6, hf_model_type="gemma3_text")
_GEMMA3_SCALED = dict(vocab_size=262208, max_seq_len=131072, sliding_window=1024, rope_scaling_type="linear",
                      rope_scaling_factor=8.0)

_LLAMA31_ROPE = dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_seq_len=8192)

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
    # Official sizes, from each model's config.json on the HF hub.
    # openai-community/gpt2{,-medium,-large,-xl}.
    "gpt2": _gpt2(dim=768, num_layers=12, num_heads=12),
    "gpt2-medium": _gpt2(dim=1024, num_layers=24, num_heads=16),
    "gpt2-large": _gpt2(dim=1280, num_layers=36, num_heads=20),
    "gpt2-xl": _gpt2(dim=1600, num_layers=48, num_heads=25),
    # meta-llama/Llama-2-{7b,13b,70b}-hf.
    "llama2-7b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008,
                      vocab_size=32000, max_seq_len=4096),
    "llama2-13b": dict(dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, ffn_dim=13824,
                       vocab_size=32000, max_seq_len=4096),
    "llama2-70b": dict(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                       vocab_size=32000, max_seq_len=4096),
    # meta-llama/Meta-Llama-3-{8B,70B}.
    "llama3-8b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                       vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    # meta-llama/Llama-3.1-{8B,70B,405B}: Llama 3's shapes (405B new), 131,072-token context by
    # RoPE scaling (rope_type llama3: factor 8, low/high frequency factors 1 and 4, original 8192).
    "llama3.1-8b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                        vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, **_LLAMA31_ROPE),
    "llama3.1-70b": dict(dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_dim=28672,
                         vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, **_LLAMA31_ROPE),
    "llama3.1-405b": dict(dim=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_dim=53248,
                          vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, **_LLAMA31_ROPE),
    # mistralai/Mistral-7B-v0.1: a 4096-token sliding window in every layer.
    "mistral-7b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                       vocab_size=32000, max_seq_len=32768, sliding_window=4096),
    # mistralai/Mixtral-8x7B-v0.1 (every layer is MoE; ffn_dim is unused).
    "mixtral-8x7b": dict(dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=14336,
                         vocab_size=32000, max_seq_len=32768, rope_theta=1e6, num_experts=8,
                         experts_per_token=2, expert_ffn_dim=14336, router_aux_loss_coef=0.02),
    # allenai/OLMoE-1B-7B-0924 (its config.json: 64 experts of width 1024, 8 per token, every layer
    # MoE, no shared expert; Muennighoff et al. 2024, arXiv 2409.02060): fine-grained experts, where
    # Mixtral has 8 wide ones; QK-norm over all heads of q and of k, and the top-8 softmax
    # probabilities kept as they are (norm_topk_prob false).
    "olmoe-1b-7b": dict(dim=2048, num_layers=16, num_heads=16, num_kv_heads=16, ffn_dim=1024,
                        vocab_size=50304, max_seq_len=4096, num_experts=64, experts_per_token=8,
                        expert_ffn_dim=1024, router_aux_loss_coef=0.01, qk_norm="whole", router_normalize_topk=False,
                        hf_model_type="olmoe"),
    # Qwen/Qwen2.5-7B.
    "qwen2.5-7b": dict(dim=3584, num_layers=28, num_heads=28, num_kv_heads=4, ffn_dim=18944,
                       vocab_size=152064, max_seq_len=131072, rope_theta=1e6, norm_eps=1e-6,
                       qkv_bias=True),
    # Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} and Qwen3-30B-A3B (their config.json files, kept in
    # tests/data/hf_configs with their sources): QK-norm, head_dim 128 whatever the width.
    **{f"qwen3-{size}": dict(_QWEN3, **dims) for size, dims in {
        "0.6b": dict(dim=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, ffn_dim=3072,
                     tie_embeddings=True),
        "1.7b": dict(dim=2048, num_layers=28, num_heads=16, num_kv_heads=8, ffn_dim=6144, tie_embeddings=True),
        "4b": dict(dim=2560, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=9728,
                   tie_embeddings=True),
        "8b": dict(dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, ffn_dim=12288),
        "14b": dict(dim=5120, num_layers=40, num_heads=40, num_kv_heads=8, ffn_dim=17408),
        "32b": dict(dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128, ffn_dim=25600),
        "30b-a3b": dict(dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, ffn_dim=6144,
                        num_experts=128, experts_per_token=8, expert_ffn_dim=768, router_aux_loss_coef=0.001,
                        hf_model_type="qwen3_moe"),
    }.items()},
    # microsoft/Phi-3-mini-4k-instruct (a 2047-token sliding window) and microsoft/phi-4 (its window,
    # 16384, is its context): q, k, v and gate, up stored fused.
    "phi-3-mini": dict(dim=3072, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=8192, vocab_size=32064,
                       max_seq_len=4096, sliding_window=2047, hf_model_type="phi3"),
    "phi-4": dict(dim=5120, num_layers=40, num_heads=40, num_kv_heads=10, ffn_dim=17920, vocab_size=100352,
                  max_seq_len=16384, rope_theta=250000.0, hf_model_type="phi3"),
    # mistralai/Mistral-Small-24B-Instruct-2501: 32 heads of 128 (4096) on a 5120-wide stream.
    "mistral-small-24b": dict(dim=5120, num_layers=40, num_heads=32, num_kv_heads=8, head_dim=128, ffn_dim=32768,
                              vocab_size=131072, max_seq_len=32768, rope_theta=1e8, hf_model_type="mistral"),
    # google/gemma-2-{2b,9b,27b}-it: Gemma's sandwich (1 + w) norms, GeGLU and scales; windowed (4096) and
    # global layers alternating, soft-capped attention scores (50) and logits (30).
    "gemma-2-2b": dict(_GEMMA2, dim=2304, num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256, ffn_dim=9216,
                       query_pre_attn_scalar=256.0),
    "gemma-2-9b": dict(_GEMMA2, dim=3584, num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, ffn_dim=14336,
                       query_pre_attn_scalar=256.0),
    "gemma-2-27b": dict(_GEMMA2, dim=4608, num_layers=46, num_heads=32, num_kv_heads=16, head_dim=128, ffn_dim=36864,
                        query_pre_attn_scalar=144.0),
    # allenai/OLMo-2-1124-{7B,13B}: a norm after each branch (none before), QK-norm over all heads.
    "olmo-2-7b": dict(_OLMO2, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008),
    "olmo-2-13b": dict(_OLMO2, dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, ffn_dim=13824),
    # openai/gpt-oss-{20b,120b} (their config.json files; the gpt-oss model card, arXiv 2508.10925): attention
    # sinks, biases on q, k, v, o, the router and the experts, top-4 of 32 or 128 experts with the clamped
    # SwiGLU, 128-token windowed layers alternating with full ones, YaRN (32 over 4096, not truncated).
    "gpt-oss-20b": dict(_GPT_OSS, num_layers=24, num_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_layers=36, num_experts=128),
    # google/gemma-3-{1b,4b,12b,27b}-it (the text model of 4B and 27B): sandwich (1 + w) norms, GeGLU, QK-norm,
    # five windowed layers to one global, the windowed ones with RoPE base 10,000, the global ones 1e6
    # (scaled linearly by 8 from 4B up).
    "gemma-3-1b": dict(_GEMMA3, dim=1152, num_layers=26, num_heads=4, num_kv_heads=1, ffn_dim=6912, vocab_size=262144,
                       max_seq_len=32768, sliding_window=512, query_pre_attn_scalar=256.0),
    "gemma-3-4b": dict(_GEMMA3, **_GEMMA3_SCALED, dim=2560, num_layers=34, num_heads=8, num_kv_heads=4, ffn_dim=10240,
                       query_pre_attn_scalar=256.0),
    "gemma-3-12b": dict(_GEMMA3, **_GEMMA3_SCALED, dim=3840, num_layers=48, num_heads=16, num_kv_heads=8,
                        ffn_dim=15360, query_pre_attn_scalar=256.0),
    "gemma-3-27b": dict(_GEMMA3, **_GEMMA3_SCALED, dim=5376, num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128,
                        ffn_dim=21504, query_pre_attn_scalar=168.0),
}

# Parameter counts as published (HF hub safetensors metadata / transformers `num_parameters()`,
# tied weights counted once). Our models must match them (tests allow 0.5%).
PUBLISHED_NUM_PARAMS: dict[str, int] = {
    "gpt2": 124_439_808,  # openai-community/gpt2, GPT2LMHeadModel.num_parameters()
    "gpt2-medium": 354_823_168,  # openai-community/gpt2-medium
    "gpt2-large": 774_030_080,  # openai-community/gpt2-large
    "gpt2-xl": 1_557_611_200,  # openai-community/gpt2-xl
    "llama2-7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf safetensors metadata
    "llama2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf
    "llama2-70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf
    "llama3-8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,  # meta-llama/Meta-Llama-3-70B
    "llama3.1-8b": 8_030_261_248,  # meta-llama/Llama-3.1-8B
    "llama3.1-70b": 70_553_706_496,  # meta-llama/Llama-3.1-70B
    "llama3.1-405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B ("7.61B" on the model card)
    "olmoe-1b-7b": 6_919_161_856,  # allenai/OLMoE-1B-7B-0924 safetensors metadata
    # transformers' count (meta device) from each model's config.json (tests/data/hf_configs), which the
    # model cards round: 0.6B, 1.7B, 4.0B, 8.2B, 14.8B, 32.8B, 30.5B; 3.8B; 14.7B
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "qwen3-30b-a3b": 30_532_122_624,
    "phi-3-mini": 3_821_079_552,
    "phi-4": 14_659_507_200,
    # the same from Gemma 2's files: each its embedding (256,000 x dim) plus the Gemma 2 report's (arXiv
    # 2408.00118) non-embedding count, 2,024,517,888, 8,324,201,984 and 26,047,480,320
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    # the same from Mistral Small's and Gemma 3's files (the text models), which the cards and the Gemma 3
    # report round: 24B; 1B, 4B, 12B (text and vision), 27B (25.6B + 1.4B of embeddings); each Gemma 3's
    # count less its embedding (262,144 or 262,208 x dim) is the report's non-embedding one: 698M, 3,209M,
    # 10,759M, 25,600M
    "mistral-small-24b": 23_572_403_200,
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 3_880_263_168,
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-27b": 27_009_346_304,
    # OLMo 2's files, which the cards call 7B and 13B
    "olmo-2-7b": 7_298_617_344,
    "olmo-2-13b": 13_716_198_400,
    # gpt-oss's files, the model card's 20.91B and 116.83B (arXiv 2508.10925, Table 1)
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}


def preset_fields(preset: str) -> dict[str, Any]:
    """The field values a preset name or an HF config.json path stands for."""
    if preset in PRESETS:
        return dict(PRESETS[preset])
    if preset.endswith(".json") or Path(preset).is_dir():
        from trainfit.models.hf import model_fields_from_hf_config  # only for an HF config (a large module)

        return model_fields_from_hf_config(preset)
    raise unknown_preset(preset)


def unknown_preset(preset: str) -> ConfigError:
    """The error of a model.preset that is neither a preset's name nor a path to a config.json."""
    return ConfigError(f"model.preset={preset!r}: unknown preset; choose one of {', '.join(sorted(PRESETS))}, "
                       "give a path to an HF config.json, or set model.preset='' and every dimension")


def names_a_file(preset: str) -> bool:
    """Whether a model.preset that is no preset's name is written as a path (a .json file, or a folder
    named with a separator or as . or ..); a bare unknown name is an unknown preset wherever it is
    asked without reading the disk (the web page's server)."""
    return preset not in PRESETS and (preset.endswith(".json") or "/" in preset or os.sep in preset
                                      or preset in (".", ".."))


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
