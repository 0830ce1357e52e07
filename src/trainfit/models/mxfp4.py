"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, E8M0 block scales): how gpt-oss checkpoints store
their MoE experts' weights, read into full precision and written back.

A block is 32 values along the input dim sharing one power-of-two scale. gpt-oss's safetensors hold,
per layer N and projection P in {gate_up_proj, down_proj}:

    model.layers.N.mlp.experts.P_blocks   uint8 [E, out, G, 16]  two 4-bit codes a byte, low nibble first
    model.layers.N.mlp.experts.P_scales   uint8 [E, out, G]      the block's exponent, biased by 127

`dequantize_mxfp4` keeps that layout ([E, out, G*32]); `hf_expert_weight` is what transformers builds
from the same tensors (convert_moe_packed_tensors): the last two dims swapped, [E, in, out], the
layout GptOssExperts multiplies by (x @ W[e]).
"""

from __future__ import annotations

import math

import torch

__all__ = ["dequantize_mxfp4", "hf_expert_weight", "quantize_mxfp4"]

BLOCK_SIZE = 32
"""Values sharing one scale (OCP MX's k for every MX format)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 by code: bit 3 the sign, bits 0-2 the magnitude's index (the OCP MX spec's table)."""
E8M0_BIAS = 127
"""A scale byte e means 2**(e - 127); 0xFF means NaN in the spec."""
ROWS_PER_CHUNK = 1 << 20
"""Blocks dequantized at once: their float32 values and int32 codes take 192 MiB, against the 8.5 GB
a float32 copy of a gpt-oss-120b gate_up_proj (128 experts x 5760 x 2880) would take."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     rows_per_chunk: int = ROWS_PER_CHUNK) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G*32] values in `dtype`, in the
    blocks' layout (the caller transposes). A scale byte 0xFF gives NaN, as the spec says."""
    return _dequantize(blocks, scales, dtype, rows_per_chunk, spec_nan=True)


def hf_expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     rows_per_chunk: int = ROWS_PER_CHUNK) -> torch.Tensor:
    """What transformers' convert_moe_packed_tensors returns for the same tensors, bit for bit:
    [E, out, G, 16] -> [E, G*32, out] (dims 1 and 2 swapped), so a loader can hand it over in place of
    the tensor transformers would build. Written into the transposed tensor a few experts at a time,
    where transformers holds the untransposed copy too. Unlike the spec, and like transformers, a
    scale byte 0xFF means 2**128, not NaN."""
    if blocks.dim() < 4:
        raise ValueError(f"blocks of shape {tuple(blocks.shape)}: transformers' layout needs [E, out, G, 16]")
    *prefix, groups, _ = blocks.shape
    shape = [*prefix, groups * BLOCK_SIZE]
    shape[1], shape[2] = shape[2], shape[1]
    out = torch.empty(shape, dtype=dtype, device=blocks.device)
    target = out.transpose(1, 2)  # the blocks' layout, viewed onto the result
    rows_per_expert = max(1, math.prod(prefix[1:]) * groups)
    step = max(1, rows_per_chunk // rows_per_expert)
    for i in range(0, prefix[0], step):
        target[i:i + step] = _dequantize(blocks[i:i + step], scales[i:i + step], dtype, rows_per_chunk,
                                         spec_nan=False)
    return out


def quantize_mxfp4(values: torch.Tensor, *, rows_per_chunk: int = ROWS_PER_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] values (K a multiple of 32) -> ([..., K/32, 16] codes, [..., K/32] exponents), the
    inverse of `dequantize_mxfp4` on representable values. A block's scale is the smallest power of
    two with max|x| <= 6*scale, so nothing clips (the spec's floor(log2 max) - 2 saturates instead);
    each value then rounds to the nearest E2M1 value, ties to the even code as IEEE rounding does."""
    if values.dim() == 0 or values.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"values of shape {tuple(values.shape)}: the last dim must be a multiple of {BLOCK_SIZE}")
    if not values.is_floating_point():
        raise ValueError(f"values of dtype {values.dtype}: quantize floating-point values")
    *prefix, width = values.shape
    rows = values.reshape(-1, BLOCK_SIZE)
    blocks = torch.empty(rows.shape[0], BLOCK_SIZE // 2, dtype=torch.uint8, device=values.device)
    scales = torch.empty(rows.shape[0], dtype=torch.uint8, device=values.device)
    for r0 in range(0, rows.shape[0], rows_per_chunk):
        blocks[r0:r0 + rows_per_chunk], scales[r0:r0 + rows_per_chunk] = _quantize_rows(rows[r0:r0 + rows_per_chunk])
    groups = width // BLOCK_SIZE
    return blocks.reshape(*prefix, groups, BLOCK_SIZE // 2), scales.reshape(*prefix, groups)


def _dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, rows_per_chunk: int, *,
                spec_nan: bool) -> torch.Tensor:
    """Both public readers: the table of scales is where they differ (0xFF)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks {blocks.dtype} and scales {scales.dtype}: MXFP4 tensors are uint8")
    if blocks.shape[-1:] != (BLOCK_SIZE // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: "
                         f"expected [..., G, {BLOCK_SIZE // 2}] and [..., G]")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype}: dequantize to a floating-point dtype")
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk={rows_per_chunk}: at least 1")
    # Every product is exact in float32 (an FP4 value has 2 significant bits; the smallest is
    # 0.5 * 2**-127) but for overflow, so rounding it once into dtype gives what transformers'
    # exact ldexp into dtype gives
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    pairs = _byte_values(compute, blocks.device)
    scale_table = _scale_table(compute, blocks.device)
    codes, exps = blocks.reshape(-1, BLOCK_SIZE // 2), scales.reshape(-1)
    out = torch.empty(codes.shape[0], BLOCK_SIZE, dtype=dtype, device=blocks.device)
    for r0 in range(0, codes.shape[0], rows_per_chunk):
        chunk = pairs[codes[r0:r0 + rows_per_chunk].int()].flatten(1)  # [rows, 16, 2] -> [rows, 32]
        exp = exps[r0:r0 + rows_per_chunk]
        chunk *= scale_table[exp.clamp(max=254).int()].unsqueeze(1)
        if spec_nan:
            chunk[exp == 255] = math.nan
        else:  # torch.ldexp, which transformers calls, scales exactly: 0.5 * 2**128 = 2**127, 0 stays 0
            chunk[exp == 255] *= 2
        out[r0:r0 + rows_per_chunk] = chunk
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE)


def _quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 32] values -> [n, 16] packed codes, [n] biased exponents."""
    x = rows.double()  # exact for every narrower float, and scaling by 2**-k stays exact
    if not torch.isfinite(x).all():
        raise ValueError("MXFP4 holds finite values only")
    amax = x.abs().amax(dim=1)
    # amax = m * 2**e, m in [0.5, 1): 6 * 2**(e-3) = 0.75 * 2**e covers it when m <= 0.75, else 2**(e-2)
    mantissa, exponent = torch.frexp(amax)
    k = torch.where(mantissa <= 0.75, exponent - 3, exponent - 2)
    k = torch.where(amax == 0, -E8M0_BIAS, k).clamp(min=-E8M0_BIAS)
    if (k > E8M0_BIAS).any():
        raise ValueError(f"a block's max magnitude {amax.max().item()} exceeds MXFP4's 6 * 2**{E8M0_BIAS}")
    magnitude = torch.ldexp(x.abs(), -k.unsqueeze(1))
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=rows.device)
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=rows.device)
    for j, midpoint in enumerate(((grid[1:] + grid[:-1]) / 2).tolist()):
        # a tie between codes j and j+1 goes to the even one
        codes += magnitude > midpoint if j % 2 == 0 else magnitude >= midpoint
    codes |= torch.signbit(x).to(torch.uint8) << 3
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (k + E8M0_BIAS).to(torch.uint8)


def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: a byte's two values, low nibble first (the element before the high nibble's)."""
    byte = torch.arange(256)
    e2m1 = torch.tensor(E2M1_VALUES, dtype=dtype)
    return torch.stack([e2m1[byte & 0x0F], e2m1[byte >> 4]], dim=1).to(device)


def _scale_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[255]: 2**(e - 127) for each scale byte but 0xFF, exact (2**-127 is a float32 subnormal)."""
    return torch.tensor([math.ldexp(1.0, e - E8M0_BIAS) for e in range(255)], dtype=dtype, device=device)
