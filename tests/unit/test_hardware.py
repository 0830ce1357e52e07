"""hardware.py: catalog figures as the datasheets state them, link presets, overrides, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainfit import hardware
from trainfit.config import ConfigError, HardwareConfig, field_docs
from trainfit.configure import load_config

TERA, GB = 1e12, 1e9


def hw(**fields: object) -> HardwareConfig:
    return HardwareConfig(**fields)


@pytest.mark.parametrize(
    ("gpu", "mode", "tflops"),
    [
        ("H100-SXM-80GB", "bf16-mixed", 989.4),  # datasheet: 1,979 with sparsity
        ("H100-SXM-80GB", "fp8-mixed", 1978.9),
        ("H100-PCIe-80GB", "bf16-mixed", 756.0),
        ("H200-141GB", "bf16-mixed", 989.4),
        ("A100-SXM-80GB", "bf16-mixed", 312.0),
        ("A100-40GB", "fp32", 19.5),
        ("L40S", "bf16-mixed", 362.05),
        ("RTX-4090", "bf16-mixed", 165.2),  # FP32 accumulate: half the FP16-accumulate rate
        ("MI300X", "bf16-mixed", 1307.4),
        ("MI300X", "fp8-mixed", 2614.9),
        ("B200", "bf16-mixed", 2250.0),  # HGX B200: 4.5 PFLOPS with sparsity
        ("B200", "fp8-mixed", 4500.0),
        ("GB200", "bf16-mixed", 2500.0),  # 1,200 W in an NVL72 rack
        ("B300", "bf16-mixed", 2250.0),  # HGX B300: 36 PFLOPS with sparsity over 8 GPUs
        ("H800-SXM-80GB", "bf16-mixed", 989.4),  # the H100 SXM's compute
        ("MI325X", "fp8-mixed", 2614.9),
        ("L4", "bf16-mixed", 121.0),  # 242 with sparsity
        ("L4", "fp8-mixed", 242.5),
        ("RTX-A6000", "bf16-mixed", 154.8),
        ("MI355X", "bf16-mixed", 2500.0),  # AMD's dense figure (5,000 with structured sparsity)
        ("MI355X", "fp8-mixed", 5000.0),
        ("H20", "bf16-mixed", 148.0),
        ("H20", "fp8-mixed", 296.0),
        ("A10G", "bf16-mixed", 125.0),  # the A10's: 250 with sparsity
        ("RTX-5090", "bf16-mixed", 209.6),  # FP32 accumulate: a quarter of the sparse FP16-accumulate 838.4
        ("RTX-3090", "bf16-mixed", 71.0),
    ],
)
def test_dense_peaks_are_the_datasheets(gpu: str, mode: str, tflops: float) -> None:
    assert hardware.peak_flops(hw(gpu=gpu), mode) == pytest.approx(tflops * TERA)


def test_memory_is_what_the_driver_reports() -> None:
    nominal_gib = {"H100-SXM-80GB": 80, "H100-PCIe-80GB": 80, "H200-141GB": 141, "A100-SXM-80GB": 80,
                   "A100-40GB": 40, "L40S": 48, "RTX-4090": 24, "MI300X": 192, "B200": 192, "GB200": 192,
                   "B300": 270, "H800-SXM-80GB": 80, "MI325X": 256, "L4": 24, "RTX-A6000": 48, "MI355X": 288,
                   "H20": 96, "A10G": 24, "RTX-5090": 32, "RTX-3090": 24}
    for name, gib in nominal_gib.items():
        spec = hardware.GPUS[name]
        assert 0.93 * gib * 2**30 < spec.memory_bytes <= gib * 2**30, name  # binary, minus what the driver keeps
        assert spec.default_link in hardware.LINKS
    assert hardware.GPUS["H100-SXM-80GB"].memory_bytes == 81559 * 2**20
    assert hardware.GPUS["H200-141GB"].hbm_bytes_per_s == 4.8e12
    assert hardware.GPUS["B200"].memory_bytes == 183359 * 2**20  # nvidia-smi on a B200


FP8_TENSOR_CORES = {"H100-SXM-80GB", "H100-PCIe-80GB", "H200-141GB", "H800-SXM-80GB", "L40S", "L4", "RTX-4090",
                    "MI300X", "MI325X", "B200", "GB200", "B300", "MI355X", "H20", "RTX-5090"}
"""Ada, Hopper, Blackwell and MI300/MI350-class parts; Ampere (A100, A10G, RTX A6000, RTX 3090) has none."""


@pytest.mark.parametrize("name", list(hardware.GPUS))
def test_every_entry_has_its_figures_and_fp8_only_with_fp8_tensor_cores(name: str) -> None:
    spec = hardware.GPUS[name]
    assert spec.memory_bytes > 0 and spec.hbm_bytes_per_s > 0 and spec.peak_flops["bf16"] > 0
    assert ("fp8" in spec.peak_flops) == (name in FP8_TENSOR_CORES)
    assert spec.default_link in hardware.LINKS and spec.host_link in hardware.LINKS


def test_device_names_as_torch_reports_them() -> None:
    names = {"NVIDIA B200": "B200", "NVIDIA GB200": "GB200", "NVIDIA B300 SXM6 AC": "B300",
             "NVIDIA H800": "H800-SXM-80GB", "NVIDIA H800 PCIe": None, "AMD Instinct MI325X": "MI325X",
             "NVIDIA L4": "L4", "NVIDIA L40S": "L40S", "NVIDIA RTX A6000": "RTX-A6000",
             "NVIDIA RTX 6000 Ada Generation": None, "NVIDIA H100 80GB HBM3": "H100-SXM-80GB",
             "AMD Instinct MI355X": "MI355X", "NVIDIA H20": "H20", "NVIDIA H200": "H200-141GB",
             "NVIDIA A10G": "A10G", "NVIDIA A10": None, "NVIDIA GeForce RTX 5090": "RTX-5090",
             "NVIDIA GeForce RTX 3090": "RTX-3090", "NVIDIA GeForce RTX 3090 Ti": None}
    assert {name: hardware.catalog_gpu_of(name) for name in names} == names


def test_an_nvl72_rack_is_one_nvlink_domain_of_72() -> None:
    """GB200 NVL72: with hardware.gpus_per_node=72 a 64-way group stays on NVLink 5; at the default 8
    (an HGX board) it crosses the network."""
    from trainfit.perf.comms import span_is_intra_node

    gb200 = hw(gpu="GB200", num_gpus=72, gpus_per_node=72, comm_efficiency=1.0)
    assert hardware.intra_node_link(gb200).name == "nvlink5"
    assert hardware.intra_node_link(gb200).bytes_per_s == 900 * GB
    assert span_is_intra_node(64, 1, 72, gb200.gpus_per_node)
    assert not span_is_intra_node(64, 1, 72, 8)


def test_indicative_prices_are_catalog_devices_at_plausible_rates() -> None:
    """Every priced device is in the catalog at a plausible on-demand rate; the ones the comment cites
    have an entry, and those with no published price found have none."""
    prices = hardware.PRICE_PER_GPU_HOUR
    assert set(prices) <= set(hardware.GPUS)
    assert all(0.05 < usd < 20 for usd in prices.values())
    assert set(prices) == set(hardware.GPUS) - {"H800-SXM-80GB", "H20", "MI355X"}
    assert prices["H100-SXM-80GB"] > prices["H100-PCIe-80GB"] > prices["RTX-4090"]
    assert prices["B300"] > prices["B200"] > prices["H200-141GB"]
    assert hardware.price_per_gpu_hour(hw(gpu="MI300X")) == prices["MI300X"]
    assert hardware.price_per_gpu_hour(hw(gpu="MI300X", price_per_gpu_hour=2.5)) == 2.5
    assert hardware.price_per_gpu_hour(hw(gpu="H20")) is None


def test_a_gpu_without_fp8_says_so() -> None:
    with pytest.raises(ConfigError, match=r"precision.mode='fp8-mixed': A100-SXM-80GB has no fp8"):
        hardware.peak_flops(hw(gpu="A100-SXM-80GB"), "fp8-mixed")


def test_link_presets_and_per_gpu_network_share() -> None:
    h100 = hw(gpu="H100-SXM-80GB", comm_efficiency=1.0)
    assert hardware.intra_node_link(h100).name == "nvlink4"
    assert hardware.intra_node_link(h100).bytes_per_s == 450 * GB
    assert hardware.intra_node_link(hw(gpu="A100-40GB", comm_efficiency=1.0)).bytes_per_s == 300 * GB
    assert hardware.intra_node_link(hw(gpu="L40S")).name == "pcie4"
    assert hardware.inter_node_link(h100).bytes_per_s == 50 * GB  # one 400 Gb/s NIC per GPU
    assert hardware.inter_node_link(hw(gpu="H100-SXM-80GB", comm_efficiency=1.0, nics_per_node=4)
                                    ).bytes_per_s == 25 * GB
    assert hardware.inter_node_link(hw(inter_node_link="ib-hdr", comm_efficiency=1.0)).bytes_per_s == 25 * GB
    assert hardware.inter_node_link(hw(inter_node_link="roce-100", comm_efficiency=1.0)).bytes_per_s == 12.5 * GB
    # the default efficiency applies to every link
    assert hardware.intra_node_link(hw(gpu="H100-SXM-80GB")).bytes_per_s == 450 * GB * hardware.COMM_EFFICIENCY


def test_every_figure_can_be_overridden() -> None:
    custom = hw(gpu="H100-SXM-80GB", peak_tflops=500, memory_gib=64, hbm_tbps=2.5, intra_node_link="pcie5",
                intra_node_gbps=100, inter_node_gbps=10, intra_node_latency_us=1, inter_node_latency_us=20,
                compute_efficiency=0.6, comm_efficiency=0.5)
    spec = hardware.device_spec(custom)
    assert spec.peak_flops["bf16"] == 500 * TERA and spec.memory_bytes == 64 * 2**30
    assert spec.hbm_bytes_per_s == 2.5e12
    intra, inter = hardware.intra_node_link(custom), hardware.inter_node_link(custom)
    assert (intra.name, intra.bytes_per_s, intra.latency_s) == ("pcie5", 50 * GB, pytest.approx(1e-6))
    assert (inter.bytes_per_s, inter.latency_s) == (5 * GB, pytest.approx(20e-6))
    assert hardware.compute_efficiency(custom) == 0.6
    assert hardware.compute_efficiency(hw()) == hardware.COMPUTE_EFFICIENCY == 0.5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--hardware.gpu=H300", "hardware.gpu='H300': unknown device; choose one of cpu, H100-SXM-80GB"),
        ("--hardware.inter_node_link=infiniband", "hardware.inter_node_link='infiniband': unknown link; choose one "
                                                  "of nvlink4, nvlink3, infinity-fabric, pcie5, pcie4, ib-ndr"),
        ("--hardware.intra_node_link=nvlink6", "hardware.intra_node_link='nvlink6': unknown link"),
        ("--hardware.compute_efficiency=1.5", "hardware.compute_efficiency=1.5: must be a fraction"),
        ("--hardware.inter_node_gbps=-1", "hardware.inter_node_gbps=-1.0: must be >= 0"),
        ("--hardware.gpus_per_node=0", "hardware.gpus_per_node=0: must be >= 1"),
        ("--hardware.nics_per_node=-2", "hardware.nics_per_node=-2: must be >= 0"),
    ],
)
def test_errors_name_field_value_and_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        load_config(None, [override])


def test_every_hardware_field_is_documented() -> None:
    docs = field_docs(HardwareConfig)
    assert set(docs) == {f for f in HardwareConfig.__dataclass_fields__}
    assert all(len(text) > 10 for text in docs.values())


def test_the_analytic_path_imports_no_torch() -> None:
    code = ("import sys, trainfit.hardware, trainfit.perf.flops, trainfit.perf.comms, trainfit.perf.timing; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
