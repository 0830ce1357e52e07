"""YaRN RoPE scaling (Peng et al. 2023, arXiv 2309.00071; DeepSeek-V3, gpt-oss, Qwen's long-context
checkpoints): pure functions of the RoPE settings, kept apart from the model so the frequencies a checkpoint
was trained with can be checked against transformers' (HF rope_type "yarn") without building one.

YaRN splits the rotary pairs by how many turns each makes over the original context L, r = L / wavelength:
pairs turning more than beta_fast times keep their frequency (extrapolation: they already saw every angle),
pairs turning fewer than beta_slow times are divided by `factor` (interpolation: positions past L would give
them angles never seen), and those between are blended. The paper's ramp is linear in r; the released
implementation, every YaRN checkpoint and transformers ramp linearly in the pair index between the two
"correction dims" where r equals beta_fast and beta_slow, and that is what is computed here. The softmax is
sharpened back by multiplying cos and sin by the attention factor, sqrt(1/t) = 0.1 ln(factor) + 1.

Shape suffixes: K2 half the rotated head width (one frequency per pair of dims).
"""

from __future__ import annotations

import math

import torch


def correction_dim(num_rotations: float, head_dim: int, base: float, original_max_seq_len: int) -> float:
    """The (fractional) pair index whose wavelength 2 pi base^(2 i / head_dim) fits `num_rotations` times
    into the original context: solving L / wavelength = num_rotations for i."""
    return head_dim * math.log(original_max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(inv_freq_K2: torch.Tensor, *, head_dim: int, base: float, factor: float,
                     original_max_seq_len: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                     truncate: bool = True) -> torch.Tensor:
    """The scaled inverse frequencies from the unscaled ones, inv_freq_K2 = base^(-2i / head_dim), with
    head_dim the rotated width (HF's head_dim * partial_rotary_factor). `truncate` floors the lower and ceils
    the upper correction dim to whole pairs, as the released YaRN code did (HF's default); gpt-oss was trained
    without it. The range is clipped to [0, head_dim - 1] as transformers clips it: a full head_dim, not the
    last pair, which only differs when even the slowest pair turns more than beta_slow times over L."""
    low = correction_dim(beta_fast, head_dim, base, original_max_seq_len)  # fast turns: low pair indices
    high = correction_dim(beta_slow, head_dim, base, original_max_seq_len)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero; transformers widens it the same way
    pair_K2 = torch.arange(inv_freq_K2.shape[-1], dtype=torch.float32, device=inv_freq_K2.device)
    interpolated_K2 = ((pair_K2 - low) / (high - low)).clamp(0.0, 1.0)  # 0: kept, 1: divided by factor
    return inv_freq_K2 * (1 - interpolated_K2) + inv_freq_K2 / factor * interpolated_K2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """0.1 mscale ln(factor) + 1, and 1 for factor <= 1 (no interpolation, nothing to sharpen back). DeepSeek-V3
    also multiplies its softmax scale by yarn_mscale(factor, mscale_all_dim) ** 2 (modeling_deepseek_v3's
    yarn_apply_mscale), apart from the cos/sin factor below."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, *, mscale: float | None = None, mscale_all_dim: float | None = None,
                          attention_factor: float | None = None) -> float:
    """What cos and sin are multiplied by. An explicit `attention_factor` (HF's key of that name) wins
    whatever the factor. Otherwise, with both mscale and mscale_all_dim set and non-zero (DeepSeek's form,
    as transformers tests them), the ratio yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim):
    DeepSeek-V3 sets both to 1, so its tables are unscaled and the sharpening sits in the softmax scale.
    Else the paper's 0.1 ln(factor) + 1."""
    if attention_factor is not None:
        return float(attention_factor)
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
