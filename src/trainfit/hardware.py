"""Device and link catalog: memory, dense peak FLOP/s per dtype, memory bandwidth, interconnects. Torch-free.

Compute figures are the vendors' dense (no sparsity) peaks; where a datasheet quotes "with
sparsity" numbers (NVIDIA's tensor-core rows, marked *), the dense figure is half of them.
Sources, checked for each entry:
- H100 SXM / PCIe: NVIDIA H100 Tensor Core GPU datasheet (SXM: FP32 67, TF32 989*, BF16/FP16 1,979*,
  FP8 3,958* TFLOPS, 3.35 TB/s; PCIe: FP32 51, TF32 756*, BF16 1,513*, FP8 3,026*, 2 TB/s).
- H200: NVIDIA H200 product page / datasheet (same Hopper compute as H100 SXM; 141 GB HBM3e, 4.8 TB/s).
- A100: NVIDIA A100 datasheet (FP32 19.5, TF32 156, BF16 312 dense; 80 GB SXM 2,039 GB/s, 40 GB 1,555 GB/s).
- L40S: NVIDIA L40S datasheet (FP32 91.6, TF32 183 / 366*, BF16 362.05 / 733*, FP8 733 / 1,466*; 864 GB/s).
- RTX 4090: NVIDIA Ada architecture whitepaper, appendix (FP32 82.6; tensor FP16/BF16 with FP32 accumulate,
  what training uses, 165.2 dense -- GeForce parts run FP32 accumulation at half rate; FP8 330.3; 1,008 GB/s).
- MI300X: AMD Instinct MI300X datasheet (FP32 163.4, TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9 TFLOPS;
  5.3 TB/s; 7 Infinity Fabric links of 128 GB/s bidirectional each).
- B200: NVIDIA Blackwell datasheet, HGX B200 column (FP32 75, TF32 2.25*, BF16 4.5*, FP8 9* PFLOPS; 180 GB,
  7.7 TB/s), as halved in pytorch's torch/_inductor/analysis/device_info.py; PCIe Gen5 x16 to the host
  (MLPerf Inference v6.0, Nebius B200 system description).
- GB200 (NVL72): NVIDIA Blackwell technical brief, GB200 column at 1,200 W (FP32 90, TF32 1,250, BF16 2,500,
  FP8 5,000 dense; 8 TB/s), as tabulated at glennklockwood.com/garden/processors/B200; 192 GB HBM3e.
  Host link: NVLink-C2C to the Grace CPU, 900 GB/s bidirectional per superchip of two GPUs.
- B300: NVIDIA HGX B300 page (8 GPUs: FP8 72*, BF16 36*, TF32 18* PFLOPS, FP32 600 TFLOPS; per GPU BF16
  2.25 dense, as NVIDIA/cosmos-framework PR 114 reads it); 270 GB, 7.7 TB/s (Verda's per-GPU table, 2026);
  PCIe Gen6 to the host (glennklockwood.com/garden/processors/B300).
- H800 SXM: the H100 SXM's die, memory (80 GB, 3.35 TB/s) and low-precision compute, with NVLink cut to
  400 GB/s bidirectional and FP64 to 1 TFLOPS (philisun.com, "NVIDIA H800 vs H100").
- MI325X: AMD Instinct MI325X datasheet figures as tabulated at awesomeagents.ai (FP32 163.4, TF32 653.7,
  FP16/BF16 1,307.4, FP8 2,614.9; 256 GB HBM3e, 6 TB/s); 7 Infinity Fabric links and PCIe Gen5 x16
  (AMD's product text, wiaix.com); the per-link rate is taken as the MI300X's.
- L4: NVIDIA L4 datasheet (FP32 30.3, TF32 120*, BF16 242*, FP8 485*; 24 GB GDDR6, 300 GB/s, PCIe Gen4 x16).
- RTX A6000: NVIDIA RTX A6000 (FP32 38.7; tensor FP16/BF16 154.8 dense, 309.7* -- llmperf.net citing
  Microway; 48 GB GDDR6, 768 GB/s, PCIe 4.0 x16). No TF32 figure was found: the entry has none.
- MI355X: AMD Instinct MI355X product page as tabulated in stas00/ml-engineering's accelerator chapter
  (dense: FP32 157.3, FP16/BF16 2,500, FP8 5,000 TFLOPS; 288 GB HBM3e, 8 TB/s); no TF32 figure. Its
  Infinity Fabric per-link rate is taken as the MI300X's (no figure found).
- H20: the export-compliant Hopper (willitrunai.com's H20 page: 96 GB HBM3, 4.0 TB/s, FP16 148 dense, INT8
  296 TOPS, NVLink 4 at 900 GB/s bidirectional, 400 W; FP32 44, TF32 74 and 78 SMs from a Geekbench-based
  report, zangshuxian.com). NVIDIA publishes no datasheet for it; FP8 is taken at INT8's rate, as on every
  Hopper part.
- A10G (AWS G5): NVIDIA publishes no datasheet for it; the entry holds the A10's (NVIDIA A10 datasheet:
  FP32 31.2, TF32 62.5 / 125*, BF16 125 / 250*; 24 GB GDDR6, 600 GB/s, PCIe Gen4 x16), an upper bound
  for AWS's variant: set hardware.peak_tflops to what yours measures (`trainfit calibrate`).
- RTX 5090: NVIDIA RTX Blackwell architecture (170 SMs; 32 GB GDDR7, 1,792 GB/s; FP32 104.8; FP16 tensor
  838.4* with FP16 accumulate, as spheron.network's datasheet lists it, so 209.6 dense with the FP32
  accumulate training uses -- half rate on GeForce parts, as on the RTX 4090 -- and FP8 419.2); no TF32
  figure. PCIe Gen5 x16, no NVLink.
- RTX 3090: NVIDIA Ampere GA102 whitepaper, appendix (FP32 35.6; TF32 35.6 dense; FP16/BF16 tensor with
  FP32 accumulate 71 dense; 24 GB GDDR6X, 936 GB/s; PCIe Gen4 x16).

Blackwell's MXFP8 (block-scaled FP8): no datasheet found gives it a row apart from FP8, so the catalog
stores no "mxfp8" peak; fp8-mixed reads the fp8 peak, the rate MXFP8 matmuls would be bounded by too.
Memory: vendors' "80GB" is binary capacity (HBM stacks are 16 GiB each); `memory_bytes` is what the
driver reports as the device total (nvidia-smi memory.total: H100 80GB 81559 MiB, H200 143771 MiB,
A100 80GB 81920 MiB, A100 40GB 40960 MiB, L40S 46068 MiB, RTX 4090 24564 MiB, B200 183359 MiB in
NVIDIA/TensorRT-LLM issue 10278; rocm-smi for MI300X: 205,822,885,888 B). The CUDA context, allocator
slack and NCCL's buffers come out of it as `reserved_margin`. Where no driver report was found (GB200 192,
B300 270, H800 80, MI325X 256, L4 24, RTX A6000 48, MI355X 288, H20 96, A10G 24, RTX 5090 32, RTX 3090 24)
the datasheet's GB are taken as GiB: an upper bound
(B200's driver shows 179 of its 192 GiB), so set hardware.memory_gib to what nvidia-smi shows.

Host links (CPU offload's copies): the datasheets' host interface, PCIe Gen5 x16 (128 GB/s
bidirectional) on H100 SXM/PCIe, H200, H800, H20, B200, RTX 5090 and MI300X/MI325X/MI355X; Gen4 x16
(64 GB/s) on A100, A10G, L40S, L4, RTX 4090, RTX 3090 and RTX A6000; Gen6 x16 on B300; NVLink-C2C on GB200.

A GB200 NVL72 rack is one NVLink domain of 72 GPUs: the intra-node link spans hardware.gpus_per_node
GPUs (perf/comms.py), so set hardware.gpus_per_node=72 for it; the default stays 8, an HGX board.

Links are per direction and per GPU. Latencies are per ring step of NCCL's Simple protocol, the one
large messages use (NCCL src/graph/tuning.cc, hwLat Ring/Simple: NVLink 3.4 us, PCIe 5.7 us, network
9.6 us, plus a base of 8.4 us per collective).

A measured profile (hardware.profile, written by `trainfit calibrate`; trainfit.hardware_profile)
replaces the catalog's figures of this machine: matmul FLOP/s per dtype as the peak (compute
efficiency 1.0: the rate is what matmuls reach), memory bandwidth, and the fitted collective
bandwidth and latency as the intra-node link (comm efficiency 1.0: measured, not nominal). Device
memory stays the catalog's, and the inter-node link too: one machine measures no network.
Explicit hardware.* overrides still win over the profile.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainfit.config.schema import ConfigError, HardwareConfig, field_error

if TYPE_CHECKING:
    from trainfit.hardware_profile import HardwareProfile

TERA = 1e12
GIB = 1024**3
MIB = 1024**2
GB = 1e9

# Fraction of the dense peak that a training step's compute reaches on the CPU without a measured
# profile (a catalog GPU prices each kernel at its published achievable rate instead:
# trainfit.perf.gpu_kernels). Large bf16 GEMMs run at 60-80% of peak on H100/A100; norms, softmax,
# the optimizer step and launch gaps bring a whole step's compute near one half. Measured end-to-end
# MFU of tuned runs, which also pay for communication and pipeline bubbles, brackets it: Llama 3 405B
# 38-43% on 16k H100 (Dubey et al. 2024, Table 4), PaLM 540B 46.2% (Chowdhery et al. 2022), MegaScale
# 175B 55.2% on 12k A100 (Jiang et al. 2024).
COMPUTE_EFFICIENCY = 0.5

# Fraction of a link's nominal bandwidth that NCCL collectives reach (bus bandwidth). nccl-tests
# all_reduce on 8 x A100 SXM NVLink gives 230-250 GB/s of 300; 400 Gb/s InfiniBand NICs give ~45 of 50
# GB/s; PCIe peer traffic often less. 0.8 is the round middle; override with hardware.comm_efficiency.
COMM_EFFICIENCY = 0.8

# Host memory bandwidth one GPU's share of a node reaches: the optimizer step of CPU offload runs there.
# A DGX/HGX H100 node has 2 Xeon 8480C sockets x 8 DDR5-4800 channels x 38.4 GB/s = 614 GB/s for 8 GPUs,
# 77 GB/s each; STREAM-type kernels reach ~75% of nominal DRAM bandwidth: ~58 GB/s.
HOST_MEMORY_BYTES_PER_S_PER_GPU = 58e9

# NCCL's fixed cost of launching one collective (tuning.cc baseLat, Ring/Simple), in seconds.
COLLECTIVE_BASE_LATENCY_S = 8.4e-6


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    """Device memory the driver reports (binary units; see the module docstring)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by compute dtype: fp32 (non-tensor), tf32, bf16, fp16, fp8."""
    hbm_bytes_per_s: float
    default_link: str
    """The intra-node link such devices usually sit on (a key of LINKS)."""
    host_link: str = ""
    """The device's link to host memory (a key of LINKS; "" for the CPU, which is the host)."""


def _gpu(name: str, mem_mib: int, fp32: float, tf32: float | None, bf16: float, fp8: float | None,
         hbm_tb_s: float, link: str, host: str) -> DeviceSpec:
    flops = {"fp32": fp32 * TERA, "bf16": bf16 * TERA, "fp16": bf16 * TERA}
    if tf32 is not None:
        flops["tf32"] = tf32 * TERA
    if fp8 is not None:
        flops["fp8"] = fp8 * TERA
    return DeviceSpec(name, mem_mib * MIB, flops, hbm_tb_s * 1e12, link, host)


GPUS: dict[str, DeviceSpec] = {
    s.name: s
    for s in (
        _gpu("H100-SXM-80GB", 81559, 67.0, 494.7, 989.4, 1978.9, 3.35, "nvlink4", "pcie5"),
        _gpu("H100-PCIe-80GB", 81559, 51.0, 378.0, 756.0, 1513.0, 2.0, "pcie5", "pcie5"),
        _gpu("H200-141GB", 143771, 67.0, 494.7, 989.4, 1978.9, 4.8, "nvlink4", "pcie5"),
        _gpu("A100-SXM-80GB", 81920, 19.5, 156.0, 312.0, None, 2.039, "nvlink3", "pcie4"),
        _gpu("A100-40GB", 40960, 19.5, 156.0, 312.0, None, 1.555, "nvlink3", "pcie4"),
        _gpu("L40S", 46068, 91.6, 183.0, 362.05, 733.0, 0.864, "pcie4", "pcie4"),
        _gpu("RTX-4090", 24564, 82.6, 82.6, 165.2, 330.3, 1.008, "pcie4", "pcie4"),
        _gpu("MI300X", 205_822_885_888 // MIB, 163.4, 653.7, 1307.4, 2614.9, 5.3, "infinity-fabric", "pcie5"),
        _gpu("B200", 183359, 75.0, 1125.0, 2250.0, 4500.0, 7.7, "nvlink5", "pcie5"),
        _gpu("GB200", 192 * 1024, 90.0, 1250.0, 2500.0, 5000.0, 8.0, "nvlink5", "nvlink-c2c"),
        _gpu("B300", 270 * 1024, 75.0, 1125.0, 2250.0, 4500.0, 7.7, "nvlink5", "pcie6"),
        _gpu("H800-SXM-80GB", 80 * 1024, 67.0, 494.7, 989.4, 1978.9, 3.35, "nvlink4-h800", "pcie5"),
        _gpu("MI325X", 256 * 1024, 163.4, 653.7, 1307.4, 2614.9, 6.0, "infinity-fabric", "pcie5"),
        _gpu("L4", 24 * 1024, 30.3, 60.0, 121.0, 242.5, 0.3, "pcie4", "pcie4"),
        _gpu("RTX-A6000", 48 * 1024, 38.7, None, 154.8, None, 0.768, "pcie4", "pcie4"),
        _gpu("MI355X", 288 * 1024, 157.3, None, 2500.0, 5000.0, 8.0, "infinity-fabric", "pcie5"),
        _gpu("H20", 96 * 1024, 44.0, 74.0, 148.0, 296.0, 4.0, "nvlink4", "pcie5"),
        _gpu("A10G", 24 * 1024, 31.2, 62.5, 125.0, None, 0.6, "pcie4", "pcie4"),
        _gpu("RTX-5090", 32 * 1024, 104.8, None, 209.6, 419.2, 1.792, "pcie5", "pcie5"),
        _gpu("RTX-3090", 24 * 1024, 35.6, 35.6, 71.0, None, 0.936, "pcie4", "pcie4"),
    )
}

# torch.cuda.get_device_name() as the drivers report each catalog device (NVIDIA's product names:
# "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
# "NVIDIA A100-PCIE-40GB"; ROCm: "AMD Instinct MI300X"). Parts the catalog does not hold (H100 NVL,
# H200 NVL, A100 80GB PCIe: other clocks, memory or links) match nothing rather than a neighbour.
DEVICE_NAME_PATTERNS: dict[str, str] = {
    r"\bH100 (80GB HBM3|SXM)": "H100-SXM-80GB",
    r"\bH100 PCIe\b": "H100-PCIe-80GB",
    r"\bH200( 141GB| SXM|$)": "H200-141GB",
    r"\bA100[- ]SXM4?[- ]80GB": "A100-SXM-80GB",
    r"\bA100[- ](SXM4?|PCIE)[- ]40GB": "A100-40GB",
    r"\bL40S\b": "L40S",
    r"\bRTX 4090\b": "RTX-4090",
    r"\bMI300X\b": "MI300X",
    r"\bB200\b": "B200",  # "NVIDIA B200"; \b keeps GB200 out
    r"\bGB200\b": "GB200",
    r"\bB300\b": "B300",  # "NVIDIA B300 SXM6 AC"
    r"\bH800\b(?! PCIe)": "H800-SXM-80GB",
    r"\bMI325X\b": "MI325X",
    r"\bL4\b": "L4",
    r"\bRTX A6000\b": "RTX-A6000",
    r"\bMI355X\b": "MI355X",
    r"\bH20\b": "H20",  # "NVIDIA H20"; \b keeps H200 out
    r"\bA10G\b": "A10G",
    r"\bRTX 5090\b": "RTX-5090",
    r"\bRTX 3090\b(?! Ti)": "RTX-3090",
}


def catalog_gpu_of(device_name: str) -> str | None:
    """The catalog entry of a device as torch names it (torch.cuda.get_device_name), or None."""
    for pattern, gpu in DEVICE_NAME_PATTERNS.items():
        if re.search(pattern, device_name.strip(), flags=re.IGNORECASE):
            return gpu
    return None


# Indicative on-demand cloud prices per GPU-hour (USD), for `trainfit plan --tokens`: the middle (mid) of a
# page's published range where it gives one, else one provider's list price, named. Quotes for one GPU
# span 10x across commitment terms and providers: set hardware.price_per_gpu_hour or `plan --prices` to
# your own. GPUs without an entry have no default price: H800-SXM-80GB and H20 (China-market parts: no
# published USD on-demand list price found) and MI355X (no published on-demand price found).
#   device           USD  basis                             source, date read
#   A100-SXM-80GB   1.99  mid of $1.49-2.49                 pricegpu.pages.dev/blog/h100-vs-a100-cloud-price, early 2026
#   H100-SXM-80GB   3.24  mid of $2.49-3.99                 same page, early 2026
#   H200-141GB      3.37  E2E Networks' rate                e2enetworks.com, 2026
#   H100-PCIe-80GB  2.64  mid of RunPod $1.99-Lambda $3.29  runpod.io/pricing, lambda.ai/pricing, 2026-09-25 [a]
#   A100-40GB       1.99  Lambda (A100 SXM 40GB)            lambda.ai/instances, 2026-09-20 [b]
#   L40S            1.17  mid of RunPod $0.79-Nebius $1.55  runpod.io/pricing, nebius.com/prices, 2026-09-25 [a]
#   RTX-4090        0.54  mid of RunPod's $0.34-0.74        runpod.io/pricing, 2026-09-25 [a]
#   B200            6.57  mid of RunPod $5.98-Nebius $7.15  runpod.io, lambda.ai, nebius.com, 2026-09-25 [a]
#   B300            7.42  mid of RunPod's $6.94-7.89        runpod.io/pricing, 2026-08-19 [c]
#   GB200          10.50  CoreWeave ($42.00/h, 4 GPUs)      coreweave.com/pricing, 2026-09-20 [b]
#   MI300X          1.99  median of listed rates            cliffcenter.com/research/amd-inference-economics, 2026-05-18
#   MI325X          1.95  TensorWave                        same page, 2026-05-18
#   L4              0.80  Modal ($0.7992/h)                 techbytes.app serverless GPU pricing matrix, 2026-05-07
#   RTX-A6000       0.82  Verda (1x on-demand)              verda.com/pricing, 2026-10-29 [d]
#   A10G            1.01  AWS g5.xlarge us-east-1 $1.006/h  EC2 on-demand pricing blog (amplifyapp.com), June 2026
#   RTX-5090        0.67  Akash ("starting at")             akash.network/pricing/gpus, 2026-09-20 [b]
#   RTX-3090        0.16  Akash ("starting at")             akash.network/pricing/gpus, 2026-09-20 [b]
# Provider pages as transcribed in [a] github.com/tgarg01/silybench-data derived/csv/gpu_prices.csv,
# [b] github.com/api-evangelist/<provider> plans/*pricing.yml, [c] huggingface.co/datasets/privum/ai-compute-prices,
# [d] huggingface.co/datasets/lantern-works/gpu-cloud-prices.
PRICE_PER_GPU_HOUR: dict[str, float] = {
    "A100-SXM-80GB": 1.99, "H100-SXM-80GB": 3.24, "H200-141GB": 3.37,
    "H100-PCIe-80GB": 2.64, "A100-40GB": 1.99, "L40S": 1.17, "RTX-4090": 0.54, "B200": 6.57, "B300": 7.42,
    "GB200": 10.50, "MI300X": 1.99, "MI325X": 1.95, "L4": 0.80, "RTX-A6000": 0.82, "A10G": 1.01,
    "RTX-5090": 0.67, "RTX-3090": 0.16,
}

# Nominal CPU peak per core: AVX2, 2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz = 96 GFLOP/s.
# A nominal figure for MFU on laptops and CI; override it with hardware.peak_tflops. fp8 too: a CPU
# has no fp8 units (torch._scaled_mm upcasts), so fp8-mixed trains there at no more than this.
CPU_FLOPS_PER_CORE = 96e9


def cpu_spec() -> DeviceSpec:
    cores = os.cpu_count() or 1
    peak = cores * CPU_FLOPS_PER_CORE
    return DeviceSpec("cpu", 0, {k: peak for k in ("fp32", "tf32", "bf16", "fp16", "fp8")}, 20e9, "loopback")


# ---------------------------------------------------------------- links


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bytes_per_s: float
    """Nominal bandwidth per direction: per GPU for intra-node links, per NIC for network links."""
    latency_s: float
    """Latency of one ring step (one hop) of a collective."""
    per_nic: bool
    """A network link: a GPU gets bytes_per_s x nics_per_node / gpus_per_node of it."""
    source: str
    medium: str = "host"
    """nvlink | pcie | net | host: which of NCCL's tuning rows (PROTOCOLS) its collectives follow."""


_NVLINK_HOP_S, _PCIE_HOP_S, _NET_HOP_S = 3.4e-6, 5.7e-6, 9.6e-6  # NCCL tuning.cc hwLat Ring/Simple


@dataclass(frozen=True)
class Protocol:
    """One of NCCL's low-latency protocols beside Simple (whose figures are a link's own): its fixed
    cost per collective, its latency per ring step on the medium, and the share of the link's
    bandwidth it moves data at (LL sends 8-byte words of 4 data bytes and a flag, and its busBw is
    cut further; LL128 keeps 120 of every 128 bytes)."""

    name: str
    base_s: float
    hop_s: float
    bandwidth_share: float
    """Of the link's achievable bandwidth, for all-gather and reduce-scatter inside a node."""
    bandwidth_share_reduce: float
    """For all-reduce, and for any collective across nodes."""


PROTOCOLS: dict[str, tuple[Protocol, ...]] = {
    "nvlink": (Protocol("LL", 3.6e-6, 0.47e-6, 1 / 3, 1 / 4), Protocol("LL128", 10.0e-6, 1.9e-6, 0.92, 0.92)),
    "pcie": (Protocol("LL", 3.6e-6, 1.0e-6, 1 / 3, 1 / 4),),
    "net": (Protocol("LL", 3.6e-6, 2.7e-6, 1 / 4, 1 / 4),),
}
"""NCCL's ring protocols other than Simple, by medium, from its tuning model (src/graph/tuning.cc,
ncclTopoTuneModel: baseLat Ring {LL 3.6, LL128 10.0, Simple 8.4} us; hwLat Ring NVLink {0.47, 1.9,
3.4}, PCI {1.0, 2.5, 5.7}, NET {2.7, 4.0, 9.6} us; ring LL's busBw x 1/3, or 1/4 for all-reduce and
across nodes; LL128's x 0.92). NCCL times every enabled protocol and runs the fastest; LL128 is
enabled by default over NVLink only (also across nodes on Hopper, left out here). The Simple
figures are each LinkSpec's own (COLLECTIVE_BASE_LATENCY_S and latency_s)."""

LINKS: dict[str, LinkSpec] = {
    s.name: s
    for s in (
        LinkSpec("nvlink4", 450 * GB, _NVLINK_HOP_S, False,
                 "H100/H200 SXM: 18 NVLink 4 links x 25 GB/s per direction (900 GB/s bidirectional)", "nvlink"),
        LinkSpec("nvlink3", 300 * GB, _NVLINK_HOP_S, False,
                 "A100 SXM: 12 NVLink 3 links x 25 GB/s per direction (600 GB/s bidirectional)", "nvlink"),
        LinkSpec("infinity-fabric", 448 * GB, _NVLINK_HOP_S, False,
                 "MI300X: 7 Infinity Fabric links x 64 GB/s per direction to the 7 peers (896 GB/s "
                 "bidirectional); NVLink-class hop latency assumed", "nvlink"),
        LinkSpec("pcie5", 63 * GB, _PCIE_HOP_S, False, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b", "pcie"),
        LinkSpec("pcie4", 31.5 * GB, _PCIE_HOP_S, False, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b", "pcie"),
        LinkSpec("ib-ndr", 50 * GB, _NET_HOP_S, True, "InfiniBand NDR: 400 Gb/s per NIC", "net"),
        LinkSpec("ib-hdr", 25 * GB, _NET_HOP_S, True, "InfiniBand HDR: 200 Gb/s per NIC", "net"),
        LinkSpec("roce-400", 50 * GB, _NET_HOP_S, True, "RoCE v2 over 400 GbE, per NIC", "net"),
        LinkSpec("roce-200", 25 * GB, _NET_HOP_S, True, "RoCE v2 over 200 GbE, per NIC", "net"),
        LinkSpec("roce-100", 12.5 * GB, _NET_HOP_S, True, "RoCE v2 over 100 GbE, per NIC", "net"),
        LinkSpec("nvlink5", 900 * GB, _NVLINK_HOP_S, False,
                 "B200/GB200/B300: 18 NVLink 5 links x 50 GB/s per direction (1.8 TB/s bidirectional); "
                 "NVL72 joins 72 GPUs, HGX boards 8", "nvlink"),
        LinkSpec("nvlink4-h800", 200 * GB, _NVLINK_HOP_S, False,
                 "H800 SXM: NVLink 4 cut to 400 GB/s bidirectional", "nvlink"),
        LinkSpec("nvlink-c2c", 225 * GB, _NVLINK_HOP_S, False,
                 "GB200 GPU to its Grace CPU: NVLink-C2C, 900 GB/s bidirectional per superchip, shared by "
                 "its two GPUs", "nvlink"),
        LinkSpec("pcie6", 121 * GB, _PCIE_HOP_S, False, "PCIe 6.0 x16: 64 GT/s x 16 lanes, FLIT 242/256", "pcie"),
        # Not a datasheet figure: gloo between processes of one host; a placeholder to override.
        LinkSpec("loopback", 5 * GB, 20e-6, False, "gloo through host memory (nominal, CPU runs)"),
    )
}


@dataclass(frozen=True)
class Link:
    """A link as one GPU sees it, overrides and efficiency applied: what the cost models use."""

    name: str
    bytes_per_s: float
    """Achievable bandwidth per direction for this GPU (nominal x comm efficiency)."""
    latency_s: float
    protocols: tuple[Protocol, ...] = ()
    """NCCL's protocols beside Simple on this medium (PROTOCOLS); none on a measured link, or where
    the latency is overridden (hardware.*_latency_us: a measured Simple figure) or gloo's."""


# ---------------------------------------------------------------- resolution and validation


def _fail(field: str, value: object, fix: str) -> ConfigError:
    return field_error(f"hardware.{field}", value, fix)


GPU_ALIASES = {"H100": "H100-SXM-80GB", "H200": "H200-141GB", "A100": "A100-SXM-80GB", "A100-80GB": "A100-SXM-80GB"}
"""Short names people write, for the catalog entry they mean."""


def device_type(hw: HardwareConfig) -> str:
    """torch's device type of the machine `hw` describes: "cpu", or "cuda" for every catalog GPU."""
    return "cpu" if hw.gpu == "cpu" else "cuda"


def canonical_gpu(name: str) -> str:
    """The catalog name of a device name or its short alias (H200 -> H200-141GB)."""
    return GPU_ALIASES.get(name, name)


def _catalog_spec(gpu: str) -> DeviceSpec:
    if gpu == "cpu":
        return cpu_spec()
    if gpu in GPUS:
        return GPUS[gpu]
    raise _fail("gpu", gpu, f"unknown device; choose one of cpu, {', '.join(GPUS)} "
                            "(or pick the closest and set hardware.peak_tflops / hardware.memory_gib)")


def _link_preset(field: str, name: str) -> LinkSpec:
    if name not in LINKS:
        raise _fail(field, name, "unknown link; choose one of " + ", ".join(LINKS)
                    + f" (the closest, then set hardware.{field.replace('link', 'gbps')} to your bandwidth)")
    return LINKS[name]


def measured_profile(hw: HardwareConfig) -> HardwareProfile | None:
    """The profile hardware.profile names (read once per file state), or None."""
    if not hw.profile:
        return None
    from trainfit.hardware_profile import load_profile  # read only with a measured profile

    return load_profile(hw.profile)


def validate_hardware(hw: HardwareConfig) -> None:
    """Every hardware.* value, checked by config validation (ConfigError names field, value, fix); a
    short device name becomes its catalog name."""
    hw.gpu = canonical_gpu(hw.gpu)
    _catalog_spec(hw.gpu)
    profile = measured_profile(hw)
    if profile is not None:
        from trainfit.hardware_profile import check_matches_device

        check_matches_device(profile, hw.profile, hw.gpu)
    if hw.intra_node_link:
        _link_preset("intra_node_link", hw.intra_node_link)
    _link_preset("inter_node_link", hw.inter_node_link)
    if hw.num_gpus < 1:
        raise _fail("num_gpus", hw.num_gpus, "must be >= 1")
    if hw.gpus_per_node < 1:
        raise _fail("gpus_per_node", hw.gpus_per_node, "must be >= 1")
    if hw.nics_per_node < 0:
        raise _fail("nics_per_node", hw.nics_per_node, "must be >= 0 (0 = one NIC per GPU)")
    for name in ("peak_tflops", "memory_gib", "hbm_tbps", "intra_node_gbps", "inter_node_gbps", "price_per_gpu_hour",
                 "intra_node_latency_us", "inter_node_latency_us"):
        if getattr(hw, name) < 0:
            raise _fail(name, getattr(hw, name), "must be >= 0 (0 = use the catalog)")
    for name in ("compute_efficiency", "comm_efficiency"):
        if not 0 <= getattr(hw, name) <= 1:
            raise _fail(name, getattr(hw, name), "must be a fraction in (0, 1] (0 = the default)")


def device_spec(hw: HardwareConfig) -> DeviceSpec:
    """The catalog entry named by hardware.gpu, with the profile's measured figures and then the
    hardware.* overrides applied."""
    spec = _catalog_spec(hw.gpu)
    profile = measured_profile(hw)
    flops = dict(profile.matmul_flops_per_s if profile else spec.peak_flops)
    if hw.peak_tflops:
        flops = {k: hw.peak_tflops * TERA for k in flops}
    memory = int(hw.memory_gib * GIB) if hw.memory_gib else spec.memory_bytes
    measured_hbm = profile.memory_bytes_per_s if profile else spec.hbm_bytes_per_s
    hbm = hw.hbm_tbps * 1e12 if hw.hbm_tbps else measured_hbm
    return DeviceSpec(spec.name, memory, flops, hbm, spec.default_link)


def compute_dtype_of(precision_mode: str) -> str:
    """The dtype whose peak bounds the matmuls of a precision mode."""
    return {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-pure": "bf16", "fp16-mixed": "fp16",
            "fp8-mixed": "fp8"}[precision_mode]


def peak_flops(hw: HardwareConfig, precision_mode: str) -> float:
    spec = device_spec(hw)
    dtype = compute_dtype_of(precision_mode)
    if dtype not in spec.peak_flops and hw.profile:
        raise ConfigError(f"precision.mode={precision_mode!r}: hardware.profile={hw.profile!r} has no {dtype} "
                          "matmul rate (torch._scaled_mm did not run where it was measured); use bf16-mixed")
    if dtype not in spec.peak_flops:
        raise ConfigError(f"precision.mode={precision_mode!r}: {spec.name} has no {dtype} tensor cores; "
                          "use bf16-mixed")
    return spec.peak_flops[dtype]


def compute_efficiency(hw: HardwareConfig) -> float:
    """hardware.compute_efficiency, else 1.0 for rates that are already achievable ones (a measured
    profile's, a catalog GPU's kernels: trainfit.perf.gpu_kernels), else the CPU catalog's default."""
    return hw.compute_efficiency or (1.0 if hw.profile or hw.gpu != "cpu" else COMPUTE_EFFICIENCY)


def intra_node_link_name(hw: HardwareConfig) -> str:
    """The preset the GPUs of a node are linked by: hardware.intra_node_link, else the GPU's usual one
    (a measured profile's link has a bandwidth, not a kind)."""
    return hw.intra_node_link or _catalog_spec(hw.gpu).default_link


def intra_node_link(hw: HardwareConfig) -> Link:
    """The link between two GPUs of one node, as one GPU sees it: the profile's measured one unless
    hardware.intra_node_link names a preset."""
    profile = measured_profile(hw)
    if profile and profile.link and not hw.intra_node_link:
        name, nominal, efficiency = "measured", profile.link, 1.0
    else:
        name = intra_node_link_name(hw)
        nominal, efficiency = _link_preset("intra_node_link", name), COMM_EFFICIENCY
    bandwidth = hw.intra_node_gbps * GB if hw.intra_node_gbps else nominal.bytes_per_s
    latency = hw.intra_node_latency_us * 1e-6 if hw.intra_node_latency_us else nominal.latency_s
    protocols = () if name == "measured" or hw.intra_node_latency_us else PROTOCOLS.get(nominal.medium, ())
    return Link(name, bandwidth * (hw.comm_efficiency or efficiency), latency, protocols)


def inter_node_link(hw: HardwareConfig) -> Link:
    """One GPU's share of the network between nodes: NIC bandwidth x NICs per node / GPUs per node."""
    preset = _link_preset("inter_node_link", hw.inter_node_link)
    if hw.inter_node_gbps:
        bandwidth = hw.inter_node_gbps * GB
    else:
        nics = hw.nics_per_node or hw.gpus_per_node
        bandwidth = preset.bytes_per_s * nics / hw.gpus_per_node if preset.per_nic else preset.bytes_per_s
    latency = hw.inter_node_latency_us * 1e-6 if hw.inter_node_latency_us else preset.latency_s
    protocols = () if hw.inter_node_latency_us else PROTOCOLS.get(preset.medium, ())
    return Link(hw.inter_node_link, bandwidth * (hw.comm_efficiency or COMM_EFFICIENCY), latency, protocols)


def host_link(hw: HardwareConfig) -> Link | None:
    """The link between one device and host memory (CPU offload's copies), or None on the CPU."""
    name = _catalog_spec(hw.gpu).host_link
    if not name:
        return None
    preset = LINKS[name]
    return Link(name, preset.bytes_per_s * (hw.comm_efficiency or COMM_EFFICIENCY), preset.latency_s)


def price_per_gpu_hour(hw: HardwareConfig) -> float | None:
    """hardware.price_per_gpu_hour, else the catalog's indicative price of hardware.gpu, else None."""
    return hw.price_per_gpu_hour or PRICE_PER_GPU_HOUR.get(hw.gpu)
