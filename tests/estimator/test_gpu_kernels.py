"""perf/gpu_kernels.py: what a GPU's kernels achieve, by shape, from published measurements. Torch-free."""

from __future__ import annotations

import pytest

from trainfit import hardware
from trainfit.perf import gpu_kernels as GK

H100 = GK.KERNELS["H100-SXM-80GB"]
BF16 = H100.mamf["bf16"]
HBM = hardware.GPUS["H100-SXM-80GB"].hbm_bytes_per_s


def test_a_large_gemm_loses_only_its_last_partial_wave() -> None:
    # 8192^3 in 128 x 256 tiles: 64 x 32 = 2,048 tiles over 132 SMs, 16 waves (15.5 full): 2,048 / 2,112
    seconds = GK.gemm_seconds(8192, 8192, 8192, BF16, H100.sms, 2, HBM)
    assert seconds == pytest.approx(2 * 8192**3 / (BF16 * 2048 / 2112))


def test_tile_quantization_charges_the_whole_tile() -> None:
    # 8,193 rows need 65 tiles of 128 rows: as long as 8,320 rows
    assert GK.gemm_seconds(8193, 8192, 4096, BF16, H100.sms, 2, HBM) == GK.gemm_seconds(8320, 8192, 4096, BF16,
                                                                                          H100.sms, 2, HBM)
    # fewer tiles than SMs: split over k, no wave wasted (16 x 4 tiles take half of 32 x 4's time)
    assert GK.gemm_seconds(128 * 16, 8192, 1024, BF16, H100.sms, 2, HBM) == pytest.approx(
        GK.gemm_seconds(128 * 32, 8192, 1024, BF16, H100.sms, 2, HBM) / 2)
    # 4 more tiles than the SMs hold cost a second wave: 34 x 4 tiles of 128 x 256 take twice 33 x 4's time
    one_wave = GK.gemm_seconds(128 * 33, 8192, 1024, BF16, H100.sms, 2, HBM)
    assert GK.gemm_seconds(128 * 34, 8192, 1024, BF16, H100.sms, 2, HBM) == pytest.approx(2 * one_wave)


def test_a_skinny_gemm_runs_at_the_memory_bandwidth() -> None:
    # one row against a 8192 x 8192 bf16 weight: 32 tiles split over k on 132 SMs, 128 MiB to read
    assert GK.gemm_seconds(1, 8192, 8192, BF16, H100.sms, 2, HBM) == pytest.approx(
        (8192 + 8192**2 + 8192) * 2 / HBM)


def test_a_linears_backward_is_its_two_gradient_gemms() -> None:
    fwd, bwd = GK.gemm_passes_seconds(4096, 4096, 14336, BF16, H100.sms, 2, HBM)
    assert bwd == GK.gemm_seconds(4096, 14336, 4096, BF16, H100.sms, 2, HBM) + GK.gemm_seconds(
        4096, 4096, 14336, BF16, H100.sms, 2, HBM)
    assert fwd < bwd < 2.2 * fwd


def test_measured_mamf_else_the_datasheet_fraction() -> None:
    peaks = hardware.GPUS["H100-SXM-80GB"].peak_flops
    assert GK.mamf("H100-SXM-80GB", "bf16", peaks) == 794.5e12
    assert GK.mamf("H100-SXM-80GB", "fp16", peaks) == 794.5e12  # fp16 reads bf16's
    # tf32 was not measured: the fraction of its peak that bf16's MAMF reaches
    assert GK.mamf("H100-SXM-80GB", "tf32", peaks) == pytest.approx(peaks["tf32"] * 794.5 / 989.4)
    l4 = hardware.GPUS["L4"].peak_flops
    assert GK.mamf("L4", "bf16", l4) == pytest.approx(l4["bf16"] * GK.MAMF_FRACTION_WITHOUT_MEASUREMENT)


def test_every_catalog_gpu_has_kernel_figures() -> None:
    assert set(GK.KERNELS) == set(hardware.GPUS)
    for name, kernels in GK.KERNELS.items():
        peaks = hardware.GPUS[name].peak_flops
        assert kernels.sms > 0 and kernels.source
        for dtype, rate in kernels.mamf.items():
            assert 0.5 * peaks[dtype] < rate < 1.1 * peaks[dtype], (name, dtype)


@pytest.mark.parametrize(("seq", "index"), [(100, 0), (512, 0), (4096, 3), (6000, 3), (16384, 5), (262144, 5)])
def test_attention_rates_by_sequence_length(seq: int, index: int) -> None:
    fwd, bwd = GK.attention_rates("cudnn", seq, BF16)
    assert (fwd, bwd) == (GK.ATTENTION_H100["cudnn"][0][index] * 1e12, GK.ATTENTION_H100["cudnn"][1][index] * 1e12)
    # another device scales by its bf16 MAMF
    b200 = GK.KERNELS["B200"].mamf["bf16"]
    assert GK.attention_rates("flash", seq, b200)[0] == pytest.approx(
        GK.ATTENTION_H100["flash"][0][index] * 1e12 * b200 / BF16)
