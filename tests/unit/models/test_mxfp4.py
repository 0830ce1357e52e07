"""MXFP4 (models/mxfp4.py): the E2M1 table and nibble order, power-of-two scales, round trips through
quantize_mxfp4, and bit-for-bit agreement with transformers' dequantization of gpt-oss's experts."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from trainfit.models.mxfp4 import E2M1_VALUES, dequantize_mxfp4, hf_expert_weight, quantize_mxfp4

SAME_WIDTH_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}
DTYPES = list(SAME_WIDTH_INT)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits: tells -0.0 from 0.0 and compares NaNs, which torch.equal does not."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    same = actual.view(SAME_WIDTH_INT[actual.dtype]) == expected.view(SAME_WIDTH_INT[actual.dtype])
    assert same.all(), f"{(~same).sum().item()} of {same.numel()} differ, first at {(~same).nonzero()[0].tolist()}"


def _random_mxfp4(shape: tuple[int, ...], seed: int, *, low: int = 0, high: int = 256) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.fixture(scope="module")
def convert_moe_packed_tensors() -> Callable[..., torch.Tensor]:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    if not hasattr(mxfp4, "convert_moe_packed_tensors"):
        pytest.skip("this transformers has no convert_moe_packed_tensors")
    return mxfp4.convert_moe_packed_tensors


def test_each_of_the_16_codes_at_exponent_127_is_its_e2m1_value_low_nibble_first() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes | ((15 - codes) << 4)).reshape(1, 16)  # byte i: code i low, code 15-i high
    values = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    expected = [v for i in range(16) for v in (E2M1_VALUES[i], E2M1_VALUES[15 - i])]
    assert values.shape == (32,)
    _assert_bitwise(values, torch.tensor(expected))
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
    assert math.copysign(1.0, E2M1_VALUES[8]) == -1.0  # code 8 is negative zero


def test_a_scale_byte_e_multiplies_its_block_by_2_to_the_e_minus_127() -> None:
    blocks, _ = _random_mxfp4((2, 5), seed=1)
    one = dequantize_mxfp4(blocks, torch.full((2, 5), 127, dtype=torch.uint8), torch.float64)
    for exponent in (0, 1, 64, 126, 128, 200, 254):
        shifted = dequantize_mxfp4(blocks, torch.full((2, 5), exponent, dtype=torch.uint8), torch.float64)
        _assert_bitwise(shifted, one * 2.0 ** (exponent - 127))
    scales = torch.tensor([[127, 128, 126, 0, 254]] * 2, dtype=torch.uint8)  # one scale per group of 32
    mixed = dequantize_mxfp4(blocks, scales, torch.float64).reshape(2, 5, 32)
    _assert_bitwise(mixed, one.reshape(2, 5, 32) * torch.ldexp(torch.ones(2, 5, 1, dtype=torch.float64),
                                                               scales.unsqueeze(-1).int() - 127))


def test_scale_byte_ff_is_nan_as_the_spec_says_but_2_to_the_128_for_transformers_layout() -> None:
    blocks = torch.full((1, 1, 1, 16), 0x10, dtype=torch.uint8)  # codes 0 (low) and 1 (high): 0, 0.5, ...
    scales = torch.full((1, 1, 1), 255, dtype=torch.uint8)
    assert dequantize_mxfp4(blocks, scales, torch.float32).isnan().all()
    hf = hf_expert_weight(blocks, scales, torch.float32)
    assert hf.shape == (1, 32, 1) and hf[0, 0::2].eq(0).all() and hf[0, 1::2].eq(2.0 ** 127).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 6, 3), (2, 3, 4, 5)])
def test_equals_transformers_convert_moe_packed_tensors_bit_for_bit(
        convert_moe_packed_tensors: Callable[..., torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    blocks, scales = _random_mxfp4(shape, seed=2)  # every scale byte, 0xFF, subnormals and overflow too
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    hf = hf_expert_weight(blocks, scales, dtype)
    _assert_bitwise(hf, expected)
    assert hf.is_contiguous()
    # dequantize_mxfp4 keeps the blocks' layout: transformers' is its dims 1 and 2 swapped (0xFF aside)
    finite = scales.clamp(max=254)
    _assert_bitwise(dequantize_mxfp4(blocks, finite, dtype).transpose(1, 2).contiguous(),
                    convert_moe_packed_tensors(blocks, finite, dtype=dtype))


def test_transformers_layout_is_experts_by_in_by_out() -> None:
    blocks, scales = _random_mxfp4((4, 6, 3), seed=3, low=120, high=135)  # [E, out, G, 16]
    hf = hf_expert_weight(blocks, scales, torch.float32)
    assert hf.shape == (4, 96, 6)  # [E, in = G*32, out]
    flat = dequantize_mxfp4(blocks, scales, torch.float32)
    assert flat.shape == (4, 6, 96)
    _assert_bitwise(hf[2, :, 5], flat[2, 5])
    with pytest.raises(ValueError, match=r"\[E, out, G, 16\]"):
        hf_expert_weight(blocks[0], scales[0])


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 7, 18, 71])
def test_chunked_dequantization_equals_one_chunk(rows_per_chunk: int) -> None:
    blocks, scales = _random_mxfp4((4, 6, 3), seed=4)  # 72 rows: chunks that divide it and that do not
    whole = dequantize_mxfp4(blocks, scales, torch.bfloat16, rows_per_chunk=1 << 20)
    whole_hf = hf_expert_weight(blocks, scales, torch.bfloat16, rows_per_chunk=1 << 20)
    _assert_bitwise(dequantize_mxfp4(blocks, scales, torch.bfloat16, rows_per_chunk=rows_per_chunk), whole)
    _assert_bitwise(hf_expert_weight(blocks, scales, torch.bfloat16, rows_per_chunk=rows_per_chunk), whole_hf)
    finite = dequantize_mxfp4(blocks, scales.clamp(100, 150), torch.float32)
    chunked, one = quantize_mxfp4(finite, rows_per_chunk=rows_per_chunk), quantize_mxfp4(finite)
    assert torch.equal(chunked[0], one[0]) and torch.equal(chunked[1], one[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_then_dequantize_is_exact_on_representable_values(dtype: torch.dtype) -> None:
    blocks, scales = _random_mxfp4((3, 4, 2), seed=5, low=100, high=150)
    values = dequantize_mxfp4(blocks, scales, dtype)
    again = dequantize_mxfp4(*quantize_mxfp4(values), dtype)
    _assert_bitwise(again, values)  # -0.0 included


def test_quantize_recovers_codes_and_scales_when_each_block_holds_a_4_or_a_6() -> None:
    # a magnitude of 4 or 6 pins the scale (3 and below would fit a halved one, with doubled codes)
    blocks, scales = _random_mxfp4((3, 4, 2), seed=6, low=1, high=250)
    pinned = torch.tensor([0x06, 0x0E, 0x60, 0xC0], dtype=torch.uint8)  # 4 | -6 low, or 4 | -4 high
    blocks[..., 3] = pinned[torch.arange(blocks[..., 3].numel()) % 4].reshape(blocks.shape[:-1])
    got_blocks, got_scales = quantize_mxfp4(dequantize_mxfp4(blocks, scales, torch.float32))
    assert got_blocks.dtype == got_scales.dtype == torch.uint8
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)


def test_quantize_picks_the_smallest_scale_that_fits_and_rounds_to_nearest_ties_to_even() -> None:
    rows = torch.zeros(4, 32, dtype=torch.float64)
    rows[0, :8] = torch.tensor([12.0, 1.1, 2.5, -5.0, 0.4, 0.5, 1.5, 7.0])  # amax 12 -> scale 2
    rows[1, :2] = torch.tensor([6.5, -0.1])  # just over 6 -> scale 2: 3.25 -> 3
    rows[2, :2] = torch.tensor([3.0, 0.75])  # 3 fits under 6 * 0.5: 0.75 is 1.5 * 0.5, kept
    rows[3, :2] = torch.tensor([6.0, 0.75])  # exactly 6 * 1: ties at 0.75 go to 1.0 (even code)
    blocks, scales = quantize_mxfp4(rows)
    assert scales.shape == (4, 1) and scales.flatten().tolist() == [128, 128, 126, 127]
    got = dequantize_mxfp4(blocks, scales, torch.float64)
    # x / scale: 0.55 -> 0.5; ties go to the even code: 1.25 -> 1, -2.5 -> -2, 0.25 -> 0, 0.75 -> 1, 3.5 -> 4
    assert got[0, :8].tolist() == [12.0, 1.0, 2.0, -4.0, 0.0, 0.0, 2.0, 8.0]
    assert got[1, :2].tolist() == [6.0, -0.0] and math.copysign(1.0, got[1, 1].item()) == -1.0
    assert got[2, :2].tolist() == [3.0, 0.75] and got[3, :2].tolist() == [6.0, 1.0]
    assert got[:, 8:].eq(0).all()


def test_quantize_rounds_every_value_to_the_nearest_point_of_its_blocks_grid() -> None:
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(64, 32, generator=gen, dtype=torch.float64) * torch.logspace(-30, 30, 64,
                                                                                     dtype=torch.float64)[:, None]
    blocks, scales = quantize_mxfp4(values)
    scale = torch.ldexp(torch.ones(64, dtype=torch.float64), scales.flatten().int() - 127)
    amax = values.abs().amax(dim=1)
    assert (amax <= 6 * scale).all() and (amax > 3 * scale).all()  # the smallest power of two that fits
    grid = (torch.tensor(E2M1_VALUES, dtype=torch.float64) * scale[:, None, None]).expand(64, 32, 16)
    nearest = grid.gather(2, (values[:, :, None] - grid).abs().argmin(dim=2, keepdim=True)).squeeze(2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float64), nearest)


def test_quantize_holds_tiny_blocks_at_the_smallest_scale_and_refuses_what_it_cannot_hold() -> None:
    tiny = torch.zeros(2, 32, dtype=torch.float64)
    tiny[0, 0] = 2.0 ** -127  # would want 2**-129: the smallest E8M0 scale, 2**-127, holds it as code 1.0
    blocks, scales = quantize_mxfp4(tiny)
    assert scales.flatten().tolist() == [0, 0]
    assert dequantize_mxfp4(blocks, scales, torch.float64)[0, 0].item() == 2.0 ** -127
    with pytest.raises(ValueError, match="exceeds"):
        quantize_mxfp4(torch.full((32,), 6.0 * 2.0 ** 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.full((32,), math.inf))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))


def test_dequantize_refuses_mismatched_shapes_and_dtypes() -> None:
    blocks, scales = _random_mxfp4((2, 3), seed=8)
    with pytest.raises(ValueError, match="expected"):
        dequantize_mxfp4(blocks, scales[:, :2])
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match="floating-point"):
        dequantize_mxfp4(blocks, scales, torch.int32)
