"""HF interop: config mapping, parameter counts and logits parity with transformers, both directions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainfit.config import ConfigError, ModelConfig
from trainfit.models import build_model, count_params, materialize
from trainfit.models.hf import load_hf_weights, model_fields_from_hf_config, save_hf_weights
from trainfit.models.params import param_counts

transformers = pytest.importorskip("transformers")

_LLAMA_DIMS = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
_GPT2_DIMS = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                  bos_token_id=0, eos_token_id=0)
HF_GPT_OSS = dict(_LLAMA_DIMS, head_dim=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  layer_types=["sliding_attention", "full_attention"], swiglu_limit=2.0, pad_token_id=0, eos_token_id=0)
# One small random config per supported model_type (plus tied/untied variants).
HF_CONFIGS = {
    "llama": ("LlamaConfig", dict(_LLAMA_DIMS, rope_theta=500000.0, rms_norm_eps=1e-5)),
    "llama-tied": ("LlamaConfig", dict(_LLAMA_DIMS, tie_word_embeddings=True)),
    # Llama 3.1's RoPE scaling, its original context shrunk to 16 so that the test's 12 positions
    # turn the scaled frequencies far enough to move the logits.
    "llama3.1": ("LlamaConfig", dict(_LLAMA_DIMS, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(_LLAMA_DIMS, sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(_LLAMA_DIMS, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", dict(_LLAMA_DIMS, tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen3: QK-norm, and a head width (24) that is not hidden_size / heads (16).
    "qwen3": ("Qwen3Config", dict(_LLAMA_DIMS, head_dim=24, rope_theta=1e6, tie_word_embeddings=True)),
    # Qwen3-MoE with dense layers among the routed ones: the first dense (mlp_only_layers), then every
    # second routed (decoder_sparse_step 2), the dense ones of intermediate_size.
    "qwen3-moe": ("Qwen3MoeConfig", dict(_LLAMA_DIMS, num_hidden_layers=4, head_dim=24, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                                         mlp_only_layers=[0], decoder_sparse_step=2)),
    # Mistral Small 3's shape: num_heads x head_dim (4 x 32) wider than hidden_size.
    "mistral-head-dim": ("MistralConfig", dict(_LLAMA_DIMS, head_dim=32, sliding_window=None)),
    # Phi-3 / Phi-4: q, k, v fused in one qkv_proj, gate and up in one gate_up_proj; Phi-3-mini's sliding
    # window, here 5 of the test's 12 positions.
    "phi3": ("Phi3Config", dict(_LLAMA_DIMS, pad_token_id=0, sliding_window=None)),
    "phi3-window": ("Phi3Config", dict(_LLAMA_DIMS, pad_token_id=0, sliding_window=5)),
    "mistral-window": ("MistralConfig", dict(_LLAMA_DIMS, sliding_window=4)),
    # OLMo 2: a norm after each branch (none before), QK-norm over all heads of q and of k.
    "olmo2": ("Olmo2Config", dict(_LLAMA_DIMS, rope_theta=5e5, pad_token_id=0)),
    # Gemma 3: sandwich (1 + w) norms, GeGLU, QK-norm, scaled embeddings and queries; two windowed layers
    # (5 of the 12 positions, RoPE base 100) to one global (base 1e4, scaled linearly by 4); soft-capped logits.
    "gemma3": ("Gemma3TextConfig", dict(_LLAMA_DIMS, num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=20,
                                        sliding_window=5, sliding_window_pattern=3, rope_theta=1e4,
                                        rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                                        final_logit_softcapping=3.0, pad_token_id=0)),
    # Gemma 2: Gemma's sandwich norms, GeGLU and scales, without QK-norm; windowed and global layers
    # alternating (5 of the 12 positions), soft-capped scores (eager attention) and logits, capped low
    # enough to bend the test's scores and logits.
    "gemma2": ("Gemma2Config", dict(_LLAMA_DIMS, num_hidden_layers=3, head_dim=24, query_pre_attn_scalar=20,
                                    sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                    pad_token_id=0)),
    # OLMoE: QK-norm over all heads, 4 experts (top 2) of width intermediate_size, the top-k weights not
    # renormalised; Qwen3-MoE's with norm_topk_prob false too.
    "olmoe": ("OlmoeConfig", dict(_LLAMA_DIMS, num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
    "qwen3-moe-unnormalized": ("Qwen3MoeConfig", dict(_LLAMA_DIMS, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                                      moe_intermediate_size=40, norm_topk_prob=False)),
    # gpt-oss: sinks, biases everywhere, a 5-token window on every other layer (the test's sequence is 12), the
    # clamped SwiGLU with a limit (2) its randomized weights reach; plain RoPE (YaRN has its own entry).
    "gpt-oss": ("GptOssConfig", dict(HF_GPT_OSS, rope_parameters=dict(rope_type="default", rope_theta=150000.0))),
    # YaRN (models/rope_scaling.py) over an original context of 16, so that the test's 12 positions turn the
    # stretched pairs: gpt-oss's (not truncated, the attention factor from the factor) and a Llama's (truncated,
    # DeepSeek's mscale ratio)
    "gpt-oss-yarn": ("GptOssConfig", dict(HF_GPT_OSS, rope_parameters=dict(
        rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
        original_max_position_embeddings=16, rope_theta=150000.0))),
    "llama-yarn": ("LlamaConfig", dict(_LLAMA_DIMS, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0,
        rope_theta=10000.0))),
    "gpt2": ("GPT2Config", _GPT2_DIMS),
    "gpt2-untied": ("GPT2Config", dict(_GPT2_DIMS, n_inner=96, tie_word_embeddings=False)),
}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Large random weights (gains near 1, biases nonzero) so that every piece of the network,
    attention included, visibly moves the logits; a small init leaves them dominated by embeddings."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise)
    return model


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    cls_name, kwargs = HF_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return randomize_(model, seed).eval()


def our_model(path: Path, seed: int = 1) -> tuple[torch.nn.Module, ModelConfig]:
    model = materialize(build_model(ModelConfig(preset=str(path))), "cpu")
    return randomize_(model, seed), model.cfg


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_param_count_matches_transformers(name: str, tmp_path: Path) -> None:
    theirs = hf_model(name)
    theirs.config.save_pretrained(tmp_path)
    ours = build_model(ModelConfig(preset=str(tmp_path)))
    assert count_params(ours) == theirs.num_parameters()
    assert param_counts(ours.cfg).total == count_params(ours)  # the closed form the estimator uses


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_load_transformers_checkpoint_gives_same_logits(name: str, tmp_path: Path) -> None:
    theirs = hf_model(name)
    theirs.save_pretrained(tmp_path)
    ours, cfg = our_model(tmp_path)
    load_hf_weights(ours, cfg, tmp_path)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_saved_checkpoint_loads_in_transformers_with_same_logits(name: str, tmp_path: Path) -> None:
    reference = hf_model(name)
    reference.config.save_pretrained(tmp_path / "src")
    ours, cfg = our_model(tmp_path / "src", seed=3)
    save_hf_weights(ours, cfg, tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert type(theirs).__name__ == type(reference).__name__  # written as the type it was read as
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(x).logits, ours(x), atol=1e-4, rtol=1e-4)
    # and back: our loader reads what our saver wrote
    again, _ = our_model(tmp_path / "src", seed=4)
    load_hf_weights(again, cfg, tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), ours.parameters(), strict=True))


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    theirs = hf_model("llama")
    theirs.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours, cfg = our_model(tmp_path)
    load_hf_weights(ours, cfg, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), theirs(tokens()).logits, atol=1e-4, rtol=1e-4)


def write_config(tmp_path: Path, **changes: object) -> Path:
    base = dict(model_type="llama", **_LLAMA_DIMS)
    base.update(changes)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in base.items() if v != "<drop>"}))
    return tmp_path / "config.json"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (dict(model_type="bert"), "model_type='bert': not supported"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling.low_freq_factor=None"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type='dynamic'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters.factor=None"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "truncate": "no"}), "rope_parameters.truncate="),
        (dict(hidden_size="<drop>"), "key 'hidden_size' is missing"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
              norm_topk_prob=True, mlp_only_layers=[1]), r"mlp_only_layers=[1]"),
        (dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, clip_qkv=8.0), "clip_qkv=8.0"),
        (dict(attention_bias=True), "attention_bias=True"),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
        (dict(model_type="gemma3_text", layer_types=["full_attention", "sliding_attention"]), "layer_types="),
        (dict(model_type="gemma3_text", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        (dict(model_type="gemma3", text_config=None), "text_config=None"),
        (dict(hidden_act="relu"), "hidden_act='relu'"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, changes: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match="config.json: " + expected.replace("[", r"\[")) as err:
        model_fields_from_hf_config(write_config(tmp_path, **changes))
    assert "supported" in str(err.value) or "missing" in str(err.value)


def test_config_maps_fields_and_warns_on_sliding_window(tmp_path: Path) -> None:
    write_config(tmp_path, model_type="mistral", sliding_window=16, rms_norm_eps=1e-5)
    fields = model_fields_from_hf_config(tmp_path)
    assert fields == dict(family="llama", dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=96,
                          vocab_size=300, max_seq_len=64, norm_eps=1e-5, rope_theta=10000.0,
                          rope_scaling_factor=0.0, tie_embeddings=False, qkv_bias=False, num_experts=0,
                          num_shared_experts=0, head_dim=0, qk_norm="none", norm_placement="pre", sliding_window=16,
                          mlp_activation="silu", hf_model_type="mistral")
    write_config(tmp_path, model_type="mistral", sliding_window=64)  # the whole context: plain causal
    assert model_fields_from_hf_config(tmp_path)["sliding_window"] == 0
    # Qwen2's window, from layer max_window_layers on, is not every layer's: ignored, and said so
    write_config(tmp_path, model_type="qwen2", sliding_window=16, use_sliding_window=True)
    with pytest.warns(UserWarning, match="sliding_window=16 is ignored"):
        assert model_fields_from_hf_config(tmp_path)["sliding_window"] == 0


def test_load_errors_on_mismatched_checkpoint(tmp_path: Path) -> None:
    theirs = hf_model("llama")
    theirs.save_pretrained(tmp_path / "ckpt")
    ours, cfg = our_model(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="materialized"):
        load_hf_weights(build_model(cfg), cfg, tmp_path / "ckpt")
    wrong, wrong_cfg = our_model(write_config(tmp_path, intermediate_size=80))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight gives layers\.0\.feed_forward\.w1\.weight"):
        load_hf_weights(wrong, wrong_cfg, tmp_path / "ckpt")
    shallow, shallow_cfg = our_model(write_config(tmp_path, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"have no place .*model\.layers\.1\."):
        load_hf_weights(shallow, shallow_cfg, tmp_path / "ckpt")
    deep, deep_cfg = our_model(write_config(tmp_path, num_hidden_layers=3))
    with pytest.raises(ValueError, match=r"missing, e\.g\. \['model\.layers\.2\."):
        load_hf_weights(deep, deep_cfg, tmp_path / "ckpt")


@pytest.mark.filterwarnings("ignore:.*vision tower")
def test_a_multimodal_gemma3_checkpoint_loads_its_text_model_naming_the_vision_tower(tmp_path: Path) -> None:
    """Gemma 3 4B-27B are Gemma3ForConditionalGeneration: the text model's weights sit under the language
    model's prefix beside a vision tower, which trainfit neither trains nor estimates and says so."""
    _, text = HF_CONFIGS["gemma3"]
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=299, boi_token_index=297, eoi_token_index=298)
    theirs = randomize_(transformers.Gemma3ForConditionalGeneration(config), seed=0).eval()
    theirs.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="vision tower"):
        ours, cfg = our_model(tmp_path)
    assert cfg.hf_model_type == "gemma3_text"
    with pytest.warns(UserWarning, match=r"tensors of the vision tower and its projector \(e\.g\. "):
        load_hf_weights(ours, cfg, tmp_path)
    x = tokens() % 290  # text tokens only
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(input_ids=x).logits, atol=1e-4, rtol=1e-4)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """The published gpt-oss checkpoints hold each layer's experts as MXFP4 blocks and scales
    (models/mxfp4.py): a tiny gpt-oss whose experts are exactly representable in MXFP4, saved that way, loads
    into trainfit with transformers' logits (its model holding the same values in full precision)."""
    from safetensors.torch import load_file, save_file

    from trainfit.models.mxfp4 import hf_expert_weight, quantize_mxfp4

    theirs = hf_model("gpt-oss")
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # onto MXFP4's grid, [E, in, out]
                blocks, scales = quantize_mxfp4(p.transpose(1, 2).contiguous())
                p.copy_(hf_expert_weight(blocks, scales, torch.float32))
    theirs.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors")
    ours, cfg = our_model(tmp_path)
    load_hf_weights(ours, cfg, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), theirs(tokens()).logits, atol=1e-4, rtol=1e-4)
    del tensors[next(n for n in tensors if n.endswith("_scales"))]  # blocks without their scales: refused
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="_scales beside it"):
        load_hf_weights(ours, cfg, tmp_path)


def test_gpt_oss_norm_multiplies_its_gain_in_fp32_as_transformers_does() -> None:
    """In 16-bit (bf16-pure) gpt-oss's RMSNorm (model.norm_fp32_gain) takes the gain on the fp32 normed values
    before the cast, Llama's after it: trainfit's matches transformers' GptOssRMSNorm bit for bit, and the
    Llama order would not."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from trainfit.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, 64, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.3 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    theirs, ours, llama = GptOssRMSNorm(64, eps=1e-5), RMSNorm(64, 1e-5, fp32_gain=True), RMSNorm(64, 1e-5)
    with torch.no_grad():
        for norm in (theirs, ours, llama):
            norm.to(torch.bfloat16).weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(llama(x), theirs(x))


@pytest.mark.parametrize("feature", ["--model.router_bias=true", "--model.attention_out_bias=true",
                                     "--model.swiglu_limit=7"])
def test_one_gpt_oss_feature_alone_is_refused_on_export_naming_the_rest(feature: str) -> None:
    """gpt-oss's features come together in its checkpoints: a Mixtral-shaped model with one of them would be
    written as a type that drops it, so the export refuses it and names what else a gpt_oss one needs."""
    from trainfit.configure import load_config
    from trainfit.models.hf import hf_config_dict

    cfg = load_config(None, ["--model.preset=debug-moe", "--model.num_shared_experts=0", feature]).model
    with pytest.raises(ConfigError, match="a gpt_oss checkpoint has") as err:
        hf_config_dict(cfg)
    assert str(err.value).startswith("model.attention_sinks=False")  # the first of the features it lacks
