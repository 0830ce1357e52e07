"""YaRN RoPE scaling (models/rope_scaling.py) against transformers' rope_type "yarn", built from the
configs transformers reads (GptOssConfig, DeepseekV3Config), for the released checkpoints' settings and the
edge cases transformers handles (no-op factor, mscale forms, an explicit attention_factor, truncation)."""

from __future__ import annotations

import math

import pytest
import torch

from trainfit.models.rope_scaling import correction_dim, yarn_attention_factor, yarn_frequencies, yarn_mscale

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

GPT_OSS_20B = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "truncate": False, "original_max_position_embeddings": 4096}
# DeepSeek-V3's config.json as published: the legacy `rope_scaling` key with "type", rope_theta beside it.
DEEPSEEK_V3_JSON = {"qk_rope_head_dim": 64, "max_position_embeddings": 163840, "rope_theta": 10000,
                    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}


def _base_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Unscaled frequencies as models/llama.py's rope_tables builds them."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def _gpt_oss_config(head_dim: int = 64, **rope: object) -> transformers.PretrainedConfig:
    params = {**GPT_OSS_20B, **rope}
    params = {k: v for k, v in params.items() if v is not None}
    max_len = int(params["factor"] * params["original_max_position_embeddings"])
    return transformers.GptOssConfig(head_dim=head_dim, max_position_embeddings=max_len, rope_parameters=params)


def _ours(config: transformers.PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Our functions fed from the standardized rope_parameters, the way an integration would read them."""
    rope = config.rope_parameters
    head_dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq_K2 = yarn_frequencies(
        _base_inv_freq(head_dim, rope["rope_theta"]), head_dim=head_dim, base=rope["rope_theta"],
        factor=rope["factor"], original_max_seq_len=rope["original_max_position_embeddings"],
        beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
        truncate=rope.get("truncate", True))
    factor = yarn_attention_factor(rope["factor"], mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                                   attention_factor=rope.get("attention_factor"))
    return inv_freq_K2, factor


def _assert_matches_transformers(config: transformers.PretrainedConfig) -> tuple[torch.Tensor, float]:
    ours_K2, ours_factor = _ours(config)
    theirs_K2, theirs_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(ours_K2, theirs_K2, rtol=1e-6, atol=0.0)
    assert ours_factor == pytest.approx(theirs_factor, rel=1e-12)
    return ours_K2, ours_factor


def test_gpt_oss_20b_matches_transformers_and_uses_all_three_regimes() -> None:
    config = _gpt_oss_config()
    assert config.rope_parameters["rope_theta"] == 150000.0
    inv_freq_K2, factor = _assert_matches_transformers(config)
    assert factor == pytest.approx(0.1 * math.log(32) + 1)
    base_K2 = _base_inv_freq(64, 150000.0)
    ratio_K2 = inv_freq_K2 / base_K2
    assert ratio_K2[0] == pytest.approx(1.0) and ratio_K2[-1] == pytest.approx(1 / 32)  # kept, interpolated
    assert ((ratio_K2 > 1 / 32 + 1e-3) & (ratio_K2 < 1 - 1e-3)).sum() >= 3  # a ramp between, not a step


def test_deepseek_v3_config_json_matches_transformers_with_unscaled_tables() -> None:
    config = transformers.DeepseekV3Config.from_dict(DEEPSEEK_V3_JSON)
    assert config.head_dim == 64 and config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["rope_theta"] == 10000
    inv_freq_K2, factor = _assert_matches_transformers(config)
    assert factor == 1.0  # mscale == mscale_all_dim: the sharpening is in the softmax scale instead
    assert not torch.allclose(inv_freq_K2, _base_inv_freq(64, 10000.0))


def test_deepseek_v3_softmax_scale_is_yarn_mscale_squared() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = transformers.DeepseekV3Config.from_dict(DEEPSEEK_V3_JSON)
    plain = config.qk_head_dim ** -0.5
    expected = yarn_apply_mscale(config.rope_parameters, plain)
    assert expected != pytest.approx(plain)
    assert plain * yarn_mscale(40, 1.0) ** 2 == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(0.707, 1.0), (1.0, 0.707)])
def test_mscale_ratio_matches_transformers(mscale: float, mscale_all_dim: float) -> None:
    rope = {**DEEPSEEK_V3_JSON["rope_scaling"], "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    config = transformers.DeepseekV3Config.from_dict({**DEEPSEEK_V3_JSON, "rope_scaling": rope})
    _, factor = _assert_matches_transformers(config)
    assert factor != pytest.approx(1.0) and factor != pytest.approx(0.1 * math.log(40) + 1)
    assert (factor < 1) == (mscale < mscale_all_dim)


@pytest.mark.parametrize("mscale, mscale_all_dim", [(None, 0.707), (0.707, None), (0.0, 1.0)])
def test_one_mscale_missing_or_zero_falls_back_to_the_papers_factor(mscale: float | None,
                                                                     mscale_all_dim: float | None) -> None:
    config = _gpt_oss_config(factor=40.0, mscale=mscale, mscale_all_dim=mscale_all_dim)
    _, factor = _assert_matches_transformers(config)
    assert factor == pytest.approx(0.1 * math.log(40) + 1)


@pytest.mark.parametrize("factor", [40.0, 1.0])
def test_an_explicit_attention_factor_overrides_everything(factor: float) -> None:
    config = _gpt_oss_config(factor=factor, mscale=0.707, mscale_all_dim=1.0, attention_factor=0.5)
    _, attention_factor = _assert_matches_transformers(config)
    assert attention_factor == 0.5


def test_factor_one_is_a_no_op() -> None:
    config = _gpt_oss_config(factor=1.0, original_max_position_embeddings=131072)
    inv_freq_K2, factor = _assert_matches_transformers(config)
    torch.testing.assert_close(inv_freq_K2, _base_inv_freq(64, 150000.0), rtol=1e-6, atol=0.0)
    assert factor == 1.0 and yarn_attention_factor(0.5) == 1.0 and yarn_mscale(0.5, 0.707) == 1.0


def test_truncating_the_correction_range_changes_the_ramp_as_in_transformers() -> None:
    truncated_K2, _ = _assert_matches_transformers(_gpt_oss_config(truncate=True))
    exact_K2, _ = _assert_matches_transformers(_gpt_oss_config(truncate=False))
    assert ((truncated_K2 - exact_K2).abs() / exact_K2).max() > 1e-2
    assert torch.equal(truncated_K2, yarn_frequencies(
        _base_inv_freq(64, 150000.0), head_dim=64, base=150000.0, factor=32.0, original_max_seq_len=4096))  # default


@pytest.mark.parametrize("rope, head_dim", [
    ({"beta_fast": 8.0, "beta_slow": 8.0, "truncate": False}, 64),  # equal betas: a step, not a ramp
    ({"beta_fast": 8.0, "beta_slow": 8.0, "truncate": True}, 64),
    # correction dims 5.17 and 4.78 (beta_fast < beta_slow, which transformers only warns about) floor and ceil
    # to 5 and 5: the ramp is widened by 0.001, else pair 5 would be 0 / 0
    ({"beta_fast": 95.0, "beta_slow": 110.0, "truncate": True}, 64),
    ({"rope_theta": 300.0}, 64),  # the slowest pair turns twice: the ramp's upper end lies past the last pair
    ({"original_max_position_embeddings": 128}, 64),  # no pair turns 32 times: the lower end clipped to 0
    ({"rope_theta": 1e6, "factor": 8.0, "truncate": True}, 128),
    ({"partial_rotary_factor": 0.5, "truncate": True}, 64),
])
def test_edge_cases_match_transformers(rope: dict, head_dim: int) -> None:
    _assert_matches_transformers(_gpt_oss_config(head_dim, **rope))


def test_correction_dim_is_where_the_pair_turns_that_many_times() -> None:
    for rotations in (1.0, 32.0):
        pair = correction_dim(rotations, 64, 150000.0, 4096)
        wavelength = 2 * math.pi * 150000.0 ** (2 * pair / 64)
        assert 4096 / wavelength == pytest.approx(rotations)
