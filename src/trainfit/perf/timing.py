"""Step time, throughput and MFU of a layout: compute + exposed communication + pipeline bubble. Torch-free.

Compute: the busiest rank's hardware FLOPs (trainfit.perf.flops: model FLOPs + fused-attention
backward + recomputation; the pipeline stage holding the output projection), each kind of work at
its own rate. On a catalog GPU (trainfit.perf.gpu_kernels): every GEMM of a block and the output
projection, forward and both backward products, at the device's maximum achievable matmul rate
less its shape's tile and wave quantization (or its operands' traffic at the memory bandwidth,
whichever is longer); attention at the published rate of training.attention_backend's kernel at the
sequence length; elementwise traffic (trainfit.perf.kernels.elementwise_bytes) at the memory
bandwidth. fp8-mixed runs its float8 linears (perf/fp8_casts.float8_linears: not the output
projection, not MoE's routed experts) at fp8's rate, every other matmul at bf16's, and adds
torchao's casts to fp8 as memory traffic (perf/fp8_casts.py: eager, 33 bytes per bf16 element cast
plus layout copies; under training.compile, fused, 5), so eager fp8 trails bf16 where the GEMMs it
speeds up are small against the tensors it casts. A measured profile (hardware.profile) prices the
same kinds of work at its measured rates, each slowed by what the machine's other ranks take of it
(trainfit.perf.kernels). The CPU without a profile divides the FLOPs by its dense peak times
hardware.compute_efficiency; everywhere else that setting scales the kernels' rates.

Host work: DTensor's dispatch under tensor parallelism and FSDP2's hooks, as the profile measured
them (trainfit.perf.kernels); all of it on a CPU, where the host computes too; on a GPU only what
exceeds the compute.

Optimizer step: after the backward, on the critical path, over the rank's shard: the profile's
measured fit, or AdamW's traffic (ADAMW_BYTES_PER_PARAM) at the device's memory bandwidth.

Communication: the collectives of trainfit.perf.comms.step_collectives, each timed on the link of
its mesh axes. What of it lengthens the step is decided here, and only here:

| collective                                   | exposed (on the critical path)                               |
|----------------------------------------------|--------------------------------------------------------------|
| FSDP parameter all-gather of the root unit   | all of it, every micro-batch: no compute runs before it      |
| FSDP parameter all-gathers of the blocks     | only what exceeds the compute they are prefetched behind:    |
|                                              | forward gathers behind the micro-batch's forward, backward   |
|                                              | gathers behind its backward                                  |
| FSDP gradient reduce-scatters (every         | hidden behind the micro-batch's backward (sharing it with    |
| micro-batch)                                 | the backward gathers), except the root unit's in the last    |
|                                              | micro-batch, which ends the step                             |
| DDP all-reduce, HSDP (and cp) all-reduce of  | once per step, behind the last micro-batch's backward;       |
| the shards                                   | exposed: the last bucket, the root unit's shard              |
| ZeRO-1 reduce-scatter (+ HSDP all-reduce)    | all of it: parallel/zero.py issues them after the backward,  |
| and parameter all-gather (phase "step")      | around the optimizer step, with nothing to hide behind       |
| tensor parallel (all-reduce, or AG + RS)     | all of it (no async TP)                                      |
| context parallel (K/V all-gather, dK/dV RS)  | all of it                                                    |
| expert parallel all-to-all                   | all of it                                                    |
| pipeline send/recv                           | all of it, at every micro-batch boundary                     |

CPU offload (memory.offload, FSDP2's CPUOffloadPolicy): every parameter all-gather first copies the
rank's fp32 shard (bf16-pure: bf16) from host to device, and every gradient reduce-scatter's output
(in the reduce dtype) goes back; both run on the host link behind compute as the gathers and
reductions do (what exceeds a micro-batch's forward, or its backward, is exposed, as is the last
micro-batch's final copy), and the optimizer steps the shard in host memory, fully exposed: AdamW
reads and writes the fp32 parameter and both states and reads the gradient,
ADAMW_BYTES_PER_PARAM bytes, at hardware.HOST_MEMORY_BYTES_PER_S_PER_GPU (on a CPU the host is the
device: its own optimizer step).

Overlapped traffic is assumed not to slow the compute it hides behind, and collectives on different
links not to contend. On a CPU nothing overlaps: gloo reduces and copies on the cores that compute.

Pipeline bubble: the fraction of an ideal step each rank idles, times its
compute plus its per-micro-batch exposed communication, per schedule as parallel/schedules.py
gives it. The busiest pipeline rank (most blocks, plus the output projection on the last
stage) sets the step. Where ranks time-share a CPU's cores (trainfit.perf.kernels.time_share: s
times over), a rank idle in the bubble leaves its core to the others, so the machine's work, s times
a rank's own compute, bounds the step as well as the rank's own path, its compute at the cores'
full rate plus its bubble; the bubble is what the second exceeds the first by (none for pp2 x dp2
on two cores: its stage waiting for the first micro-batch leaves both cores to the other stage).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from trainfit.config import HardwareConfig, ModelConfig, TrainingConfig
from trainfit.hardware import (
    HOST_MEMORY_BYTES_PER_S_PER_GPU,
    DeviceSpec,
    Link,
    compute_dtype_of,
    compute_efficiency,
    device_spec,
    device_type,
    host_link,
    inter_node_link,
    intra_node_link,
    measured_profile,
    peak_flops,
)
from trainfit.models import block_cost as B
from trainfit.models.architecture import (
    config_key,
    describe,
    document_mask_kernel,
    eager_attention,
    kind_of_layers,
    layer_kinds,
)
from trainfit.models.block_spec import block_linears
from trainfit.parallel.layout import Layout
from trainfit.parallel.schedules import bubble_fraction
from trainfit.parallel.stage_split import checkpointed
from trainfit.peft.spec import adapter_flop_params
from trainfit.perf import flops as F
from trainfit.perf import gpu_kernels as GK
from trainfit.perf import kernels as K
from trainfit.perf.comms import (
    KINDS,
    Collective,
    collective_time,
    group_is_intra_node,
    members_per_node,
    precision_bytes,
    stage_params,
    step_collectives,
)
from trainfit.perf.engines import TRAINFIT_ENGINE, Engine
from trainfit.perf.fp8_casts import SCALE_PRECOMPUTE_BYTES, gathered_shard_bytes, linear_cast_bytes
from trainfit.perf.kernels import float8_gemms
from trainfit.sample_rows import SampleRows

if TYPE_CHECKING:
    from trainfit.hardware_profile import HardwareProfile

# AdamW's step per parameter: the fp32 parameter, exp_avg and exp_avg_sq read and written, the gradient read.
ADAMW_BYTES_PER_PARAM = 3 * 2 * 4 + 4
# Collectives whose every call waits on the critical path.
EXPOSED_PURPOSES = frozenset({"tp", "cp", "ep", "pp", "zero1_params"})


@dataclass(frozen=True)
class PerfEstimate:
    flops: dict[str, float]
    """model_flops_per_token, hardware_flops_per_token, model_flops_per_step, hardware_flops_per_step,
    recompute_flops_per_step, flops_per_rank_per_step (hardware FLOPs of the busiest rank)."""
    time: dict[str, Any]
    """step_time_s, compute_s, fp8_cast_s (of compute_s: fp8-mixed's float8 casts), nf4_dequant_s (of
    compute_s: QLoRA's dequantizations), compute_parts_s (on a
    catalog GPU: matmul, attention, elementwise and the host's launches, s per step; {} elsewhere), comm_s {kind: total
    s}, exposed_comm_s, exposed_comm_by_kind_s {kind: s},
    offload_s {h2d, d2h, host_optimizer: s per step; empty without offload}, exposed_offload_s, bubble_s,
    bubble_fraction, exposed_host_s (the parallel frameworks' host work on the critical path), optimizer_s
    (the device's optimizer step), num_microbatches, tokens_per_second (whole
    job), mfu, hfu."""
    collectives: tuple[tuple[Collective, float], ...] = field(default=())
    """Every collective kind a rank issues, with the time of one call."""


@dataclass(frozen=True)
class Rates:
    """What a step's time reads of the hardware, resolved once: device_spec and the links apply the
    profile and the hardware.* overrides on every call, and the planner times thousands of layouts
    on one hardware."""

    hw: HardwareConfig
    device: DeviceSpec
    profile: HardwareProfile | None
    efficiency: float
    """compute_efficiency(hw)."""
    intra: Link
    inter: Link
    host: Link | None
    fits: dict[tuple[str, int], Link]
    """Collectives the profile measured, by (kind, group size): on a measured link, a collective
    measured at its group size runs at its fit (unless a hardware.* override of the link says otherwise)."""
    peaks: dict[str, float] = field(default_factory=dict, compare=False)
    """peak_flops per precision mode, as asked."""
    engine: Engine = TRAINFIT_ENGINE
    """The engine the step runs on (perf/engines.py: its host side, what it overlaps): trainfit's own,
    unless a caller prices another engine's runs (benchmarks/playbook.py: nanotron's)."""
    memo: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)
    """A layout's busiest-rank compute and timed collectives on this hardware, its GEMMs' rates and its groups'
    links, by their exact inputs (_memo): the planner's lower bounds and its estimates ask for the same
    layouts' (plan/search.py), and the settings of a layout's memory knobs share most of them."""

    @classmethod
    def of(cls, hw: HardwareConfig, engine: Engine = TRAINFIT_ENGINE) -> Rates:
        profile = measured_profile(hw)
        overridden = hw.intra_node_gbps or hw.intra_node_latency_us or hw.comm_efficiency
        fits = {(f.kind, f.world_size): Link("measured", f.bytes_per_s, f.latency_s)
                for f in (profile.collectives if profile and not overridden else ())}
        return cls(hw, device_spec(hw), profile, compute_efficiency(hw), intra_node_link(hw), inter_node_link(hw),
                   host_link(hw), fits, engine=engine)

    def peak(self, precision: str) -> float:
        """peak_flops(hw, precision), with its named error for a dtype the device has no rate for."""
        if precision not in self.peaks:
            self.peaks[precision] = peak_flops(self.hw, precision)
        return self.peaks[precision]

    def link(self, layout: Layout, axes: tuple[str, ...]) -> Link:
        """The link a group over these mesh axes runs on (perf/comms.py: its slowest hop; across nodes,
        the NICs its members on a node drive, no more than the intra-node link carries). Once per axes and
        degrees (what it reads of the layout)."""
        key = ("link", axes, layout.world_size, layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp,
               layout.tp, layout.ep)
        return _memo(self, key, lambda: self._link(layout, axes))

    def _link(self, layout: Layout, axes: tuple[str, ...]) -> Link:
        gpus_per_node = self.hw.gpus_per_node
        if group_is_intra_node(layout, axes, gpus_per_node):
            return self.intra
        members = members_per_node(layout, axes, gpus_per_node)
        if members == 1:
            return self.inter
        bandwidth = min(self.inter.bytes_per_s * members, self.intra.bytes_per_s)
        return dataclasses.replace(self.inter, bytes_per_s=bandwidth)


class RankFlops(NamedTuple):
    """The busiest rank's hardware FLOPs per step, and what of them runs where."""

    forward: float
    backward: float
    """Incl. activation checkpointing's recomputation."""
    forward_attention: float
    backward_attention: float
    forward_fp8: float
    """Of forward: the float8 linears' GEMMs (fp8-mixed; else 0)."""
    backward_fp8: float
    blocks: int
    """Blocks the rank runs."""
    wrapped: int
    """... of them checkpointed (0 without activation checkpointing)."""
    last_stage: bool = True
    """Whether the rank runs the output projection."""


def _rank_flops(m: ModelConfig, layout: Layout, t: TrainingConfig, device: str) -> RankFlops:
    """The busiest rank's hardware FLOPs per step on a `device` ("cpu", "cuda": the soft-capped attention's
    kernel, models/architecture.softcap_kernel): forward, backward incl. recomputation, the attention
    kernel's part of each, and the float8 linears' (a checkpointed block reruns them in proportion to its
    matmul FLOPs). A model whose layers differ in their tensors: each rank's blocks of each kind, its ends
    once (parallel/collectives.kind_parts' sums)."""
    if len(layer_kinds(m)) == 1:
        rank = _rank_of(m, layout, t, device)
        busiest = max((rank(*shape) for shape in layout.rank_shapes()), key=lambda f: f.forward + f.backward)
    else:
        kinds, of = layer_kinds(m), kind_of_layers(m)
        ranks = [_rank_of(kind, layout, t, device) for kind in kinds]
        wraps = layout.activation_checkpointing != "none"

        def of_rank(r: int) -> RankFlops:
            place = layout.rank_placement(r)
            parts = [ranks[0](0, 0, place.last)]  # the rank's ends
            for k, rank in enumerate(ranks):
                own = [i for i in place.blocks if of[i] == k]
                wrapped = sum(checkpointed(i, layout.ac_every_n_layers) for i in own) if wraps else 0
                parts += [rank(len(own), wrapped, place.last), rank(0, 0, place.last)]
            signs = [1] + [1, -1] * len(ranks)
            return RankFlops(*(sum(sg * p[i] for sg, p in zip(signs, parts, strict=True)) for i in range(8)),
                             place.last)

        busiest = max((of_rank(r) for r in range(layout.pp)), key=lambda f: f.forward + f.backward)
    tokens = layout.global_batch_size * t.seq_len / (layout.dp * layout.cp)  # per rank; tp ranks split its FLOPs
    return RankFlops(*(f * tokens / layout.tp for f in busiest[:6]), busiest.blocks, busiest.wrapped,
                     busiest.last_stage)


def packed_rows(layout: Layout) -> SampleRows | None:
    """The layout's rows when they pack fine-tuning samples (sample_rows.py), else None."""
    return layout.rows if layout.rows is not None and layout.rows.packed else None


def attended_length(layout: Layout, t: TrainingConfig) -> int:
    """The sequence length whose causal attention is a row's useful work: the packed samples' effective
    length (sample_rows.py), else training.seq_len. What model FLOPs and MFU count."""
    rows = packed_rows(layout)
    return rows.attended_length(t.seq_len) if rows is not None else t.seq_len


def _attention_kernel_flops(m: ModelConfig, layout: Layout, t: TrainingConfig, device: str, eager: bool) -> int:
    """What a block's attention kernel computes per token: block_cost's, or over packed rows what their
    document mask's kernel computes (sample_rows.SampleRows.kernel_length: the whole row under SDPA's
    explicit mask, FlexAttention's blocks around each sample)."""
    rows = packed_rows(layout)
    if rows is None:
        return B.block_attention_kernel_flops(m, t.seq_len, eager_softcap=eager)
    length = rows.kernel_length(t.seq_len, document_mask_kernel(device, describe(m).sinks))
    return B.block_attention_flops(m, t.seq_len, causal=False) if length is None else B.block_attention_flops(m, length)


def _rank_of(m: ModelConfig, layout: Layout, t: TrainingConfig, device: str) -> Callable[[int, int, bool], RankFlops]:
    """A rank's FLOPs per token of `m` (its layers alike) by (blocks, of them wrapped, runs the last stage)."""
    eager = eager_attention(describe(m).attention, device)
    mm, at = 2 * B.block_matmul_params(m), _attention_kernel_flops(m, layout, t, device, eager)
    rc_mm, rc_at = F.block_recompute_flops(m, t.seq_len, layout.activation_checkpointing, layout.ep)
    rc_at = rc_at * at / B.block_attention_flops(m, t.seq_len)  # the kernel's work, as for the forward
    local = sum(g.k * g.n * g.share for g in K.block_gemms(m, layout))  # one tp rank's share of a block's
    # The tp ranks split attention, the output projection and a dense block's linears; an MoE
    # feed-forward is whole on each (models/block_spec.py): its matmuls are not divided below.
    # Recomputation's matmuls are taken to split as the block's do (exact for dense blocks).
    whole = 2 * local * layout.tp / mm
    mm, rc_mm = mm * whole, rc_mm * whole
    fp8_gemms = float8_gemms(m, layout)
    fp8 = sum(g.k * g.n * g.share for g in fp8_gemms) / local if fp8_gemms else 0.0  # float8 linears' share

    adaptation = layout.adaptation
    # PEFT: the adapters' A and B run all three passes; the frozen base computes no weight gradients
    adapters = 2 * adapter_flop_params(m, adaptation) if adaptation else 0
    weight_grads = 0 if adaptation else 1

    first_skipped = 2 * F.first_block_input_grad_params(m, adaptation) * whole if adaptation else 0
    scored = layout.rows.scored_share(t.seq_len) if layout.chunked_loss and layout.rows is not None else 1.0
    attention_bwd = F.attention_backward_factor(m, eager)

    def rank(layers: int, wrapped: int, last_stage: bool) -> RankFlops:
        wrapped = 0 if layout.activation_checkpointing == "none" else wrapped
        head = 2 * B.head_matmul_params(m) * last_stage  # the last stage's rank holds the output projection
        head *= scored  # (the chunked loss projects only the rows that train)
        head_weight_grad = head * (weight_grads or bool(adaptation and adaptation.train_output))
        forward = layers * (mm + at + adapters) + head
        backward = (layers * ((1 + weight_grads) * mm + 2 * adapters + attention_bwd * at) + head
                    + head_weight_grad - first_skipped + wrapped * (rc_mm + rc_at)
                    + head * layout.chunked_loss)  # the chunked loss reruns the output projection
        return RankFlops(forward, backward, layers * at, layers * at * attention_bwd + wrapped * rc_at,
                         fp8 * layers * mm, fp8 * (2 * layers * mm + wrapped * rc_mm), layers, wrapped, last_stage)

    return rank


def _fp8_cast_bytes(m: ModelConfig, layout: Layout, t: TrainingConfig, flops: RankFlops) -> tuple[float, float]:
    """(forward, backward) bytes the busiest rank's float8 casts move per step (perf/fp8_casts.py):
    its blocks' float8 linears every micro-batch, a checkpointed block's forward casts again in
    proportion to the matmul FLOPs it reruns; under FSDP2 float8 all-gather, each all-gather's cast
    of the rank's shard and the scales' read after the optimizer step."""
    gemms = float8_gemms(m, layout)
    if not gemms:
        return 0.0, 0.0
    rows = layout.micro_batch_size * t.seq_len / layout.cp
    weight_bytes = 4 if layout.zero_stage == 0 else 2  # autocast's fp32 parameter; FSDP2 and ZeRO-1 run bf16
    casts = [linear_cast_bytes(rows * g.share, g.k, g.n, scaling=layout.fp8_scaling, compiled=layout.compile,
                               weight_bytes=weight_bytes, weight_gathered=layout.fp8_gathers) for g in gemms]
    block_fwd, block_bwd = sum(c.forward for c in casts), sum(c.backward for c in casts)
    rerun = (F.block_recompute_flops(m, t.seq_len, layout.activation_checkpointing, layout.ep)[0]
             / (2 * B.block_matmul_params(m)))
    n_mb = layout.num_microbatches
    forward = n_mb * flops.blocks * block_fwd
    backward = n_mb * (flops.blocks * block_bwd + flops.wrapped * rerun * block_fwd)
    if layout.fp8_gathers:
        shard = flops.blocks * sum(g.k * g.n for g in gemms) / layout.zero_shards
        forward += n_mb * gathered_shard_bytes(shard)
        backward += n_mb * gathered_shard_bytes(shard) * (layout.zero_stage == 3) + SCALE_PRECOMPUTE_BYTES * shard
    return forward, backward


NF4_DEQUANT_TRAFFIC_BYTES = 33
"""Bytes torchao's eager NF4 dequantization (NF4Tensor.get_original_weight) reads and writes per weight:
the packed codes split in two (1 + 1), each half widened to int64 (1 + 8), looked up in the codebook (8
read, 2 written), the block scales broadcast (2) and applied (4 + 2), the halves interleaved (2 + 2)."""
NF4_DEQUANT_TRAFFIC_BYTES_COMPILED = 2.5
"""...and fused by inductor into one kernel: the packed codes and scales read (0.5), the bf16 weight
written (2)."""


def _nf4_dequant_bytes(m: ModelConfig, layout: Layout, t: TrainingConfig, flops: RankFlops) -> tuple[float, float]:
    """(forward, backward) bytes QLoRA's dequantizations move per step (peft/nf4.py): each NF4 weight
    in every micro-batch's forward and its input gradient, and again in a checkpointed block's recompute
    in proportion to the matmul FLOPs it reruns."""
    adaptation = layout.adaptation
    if adaptation is None or not adaptation.quantized:
        return 0.0, 0.0
    per_weight = NF4_DEQUANT_TRAFFIC_BYTES_COMPILED if layout.compile else NF4_DEQUANT_TRAFFIC_BYTES
    block = per_weight * sum(linear.in_features * linear.out_features for linear in block_linears(m)
                             if linear.name in adaptation.quantized)
    # A checkpointed block's recompute reaches its last linear too: an NF4 linear is a custom autograd
    # Function, whose saved weight is packed after its forward ran (the traced step shows it)
    policy = layout.activation_checkpointing
    rerun = (F.block_recompute_flops(m, t.seq_len, policy, layout.ep)[0] / 2
             + (F.skipped_recompute_params(m) if policy == "full" else 0)) / B.block_matmul_params(m)
    n_mb = layout.num_microbatches
    return n_mb * flops.blocks * block, n_mb * (flops.blocks + flops.wrapped * rerun) * block


class ComputeTime(NamedTuple):
    forward: float
    backward: float
    fp8_casts: float
    """Of forward + backward: the float8 casts' memory traffic (fp8-mixed; else 0)."""
    parts: dict[str, float] | None = None
    """On a catalog GPU, what forward + backward spend their time on (matmuls, attention, elementwise
    traffic with fp8's casts) and the host's kernel launches, which set the pace where they exceed the
    kernels; None elsewhere."""
    matmul_flops_per_s: float = 0.0
    """The rate the rank's GEMMs run at, all of them together: what a GEMM that hides an async-TP
    collective takes (_overlapped)."""
    nf4_dequant: float = 0.0
    """Of forward + backward: QLoRA's dequantizations' memory traffic (else 0)."""


def _compute_seconds(m: ModelConfig, layout: Layout, t: TrainingConfig, rates: Rates, flops: RankFlops
                     ) -> ComputeTime:
    """_weight_conversion_seconds, with QLoRA's dequantizations told apart from fp8's casts (both are
    traffic that converts weights before their matmuls, priced alike)."""
    dequant_fwd, dequant_bwd = _nf4_dequant_bytes(m, layout, t, flops)
    compute = _weight_conversion_seconds(m, layout, t, rates, flops, dequant_fwd, dequant_bwd)
    if not dequant_fwd:
        return compute
    memory = K.concurrency_slowdown(rates.profile, rates.hw, layout)[1] if rates.profile is not None else 1.0
    dequant = memory * (dequant_fwd + dequant_bwd) / rates.device.hbm_bytes_per_s
    return compute._replace(fp8_casts=compute.fp8_casts - dequant, nf4_dequant=dequant)


def _weight_conversion_seconds(m: ModelConfig, layout: Layout, t: TrainingConfig, rates: Rates, flops: RankFlops,
                               dequant_fwd: float, dequant_bwd: float) -> ComputeTime:
    """Forward and backward compute time of the busiest rank: on the catalog, FLOPs at the peak times
    the efficiency (fp8-mixed: its float8 linears at the fp8 peak, every other matmul and attention at
    the bf16 peak, and the float8 casts' traffic at the memory bandwidth); on a measured profile, each
    kind of work at its own measured rate (trainfit.perf.kernels), the casts with the elementwise work."""
    profile, efficiency = rates.profile, rates.efficiency
    bandwidth = rates.device.hbm_bytes_per_s
    casts_fwd, casts_bwd = _fp8_cast_bytes(m, layout, t, flops)
    casts_fwd, casts_bwd = casts_fwd + dequant_fwd, casts_bwd + dequant_bwd  # weights converted alike
    if profile is not None:
        rates.peak(layout.precision)  # a named error when the profile measured no rate for the dtype
        dtype = compute_dtype_of(layout.precision)
        high = "bf16" if dtype == "fp8" else dtype  # what runs outside the float8 linears
        tokens = layout.micro_batch_size * t.seq_len / layout.cp
        fp8_gemms = float8_gemms(m, layout)
        others = [g for g in [*K.block_gemms(m, layout), K.head_gemm(m, layout)] if g not in fp8_gemms]
        matmul = K.matmul_rate(profile, high, m, layout, tokens, others) * efficiency
        matmul_fp8 = K.matmul_rate(profile, "fp8", m, layout, tokens, fp8_gemms) * efficiency if fp8_gemms else 1.0
        measured = K.attention_rate(profile, high, m, attended_length(layout, t) // layout.cp)
        attention = measured * efficiency if measured else matmul
        ew_fwd, ew_bwd = K.elementwise_bytes(m, layout, t)
        compute, memory = K.concurrency_slowdown(profile, rates.hw, layout)

        def seconds(total: float, fp8: float, att: float, elementwise: float) -> float:
            gemms = (total - fp8 - att) / matmul + fp8 / matmul_fp8 + att / attention
            return compute * gemms + memory * elementwise / bandwidth

        return ComputeTime(seconds(flops.forward, flops.forward_fp8, flops.forward_attention, ew_fwd + casts_fwd),
                           seconds(flops.backward, flops.backward_fp8, flops.backward_attention, ew_bwd + casts_bwd),
                           memory * (casts_fwd + casts_bwd) / bandwidth, None, matmul / compute)
    if rates.hw.gpu != "cpu":
        return _gpu_compute_seconds(m, layout, t, rates, flops, casts_fwd, casts_bwd)
    rate = rates.peak(layout.precision) * efficiency
    if layout.precision != "fp8-mixed":
        dequant_fwd_s, dequant_bwd_s = dequant_fwd / bandwidth, dequant_bwd / bandwidth
        return ComputeTime(flops.forward / rate + dequant_fwd_s, flops.backward / rate + dequant_bwd_s,
                           dequant_fwd_s + dequant_bwd_s, None, rate)
    high = rates.device.peak_flops["bf16"] * efficiency  # everything but the float8 linears
    return ComputeTime((flops.forward - flops.forward_fp8) / high + flops.forward_fp8 / rate + casts_fwd / bandwidth,
                       (flops.backward - flops.backward_fp8) / high + flops.backward_fp8 / rate + casts_bwd / bandwidth,
                       (casts_fwd + casts_bwd) / bandwidth, None, high)


HOPPER_AND_LATER = frozenset({"H100-SXM-80GB", "H100-PCIe-80GB", "H200-141GB", "H800-SXM-80GB", "H20", "B200",
                              "GB200", "B300"})
"""Where torch's scaled_dot_product_attention prefers cuDNN's kernel (sm90 and later, trainfit.attention)."""


def attention_kernel(backend: str, gpu: str) -> str:
    """The kernel of perf/gpu_kernels.ATTENTION_H100 that prices training.attention_backend on `gpu`:
    auto is cuDNN's from Hopper on, else FlashAttention-2's; the memory-efficient kernel, never
    measured beside them, is priced as FlashAttention-2."""
    if backend == "auto":
        return "cudnn" if gpu in HOPPER_AND_LATER else "flash"
    return "flash" if backend == "efficient" else backend


def _gpu_compute_seconds(m: ModelConfig, layout: Layout, t: TrainingConfig, rates: Rates, flops: RankFlops,
                         casts_fwd: float, casts_bwd: float) -> ComputeTime:
    """Forward and backward compute of the busiest rank on a catalog GPU, each kind of work at what
    its kernels achieve (perf/gpu_kernels.py): every GEMM at its shape's rate, attention at its
    kernel's (both times hardware.compute_efficiency), elementwise traffic and fp8's casts at the
    memory bandwidth; never faster than the host launches its kernels."""
    device, peaks = rates.hw.gpu, rates.device.peak_flops
    bandwidth = rates.device.hbm_bytes_per_s
    kernels = GK.kernels_of(device)
    sms = kernels.sms if kernels else GK.DEFAULT_SMS
    dtype = compute_dtype_of(layout.precision)
    rates.peak(layout.precision)  # a named error when the device has no rate for the dtype
    high = "bf16" if dtype == "fp8" else dtype
    tokens = layout.micro_batch_size * t.seq_len / layout.cp

    def rate(gemms: list[tuple[K.Gemm, int]], dt: str) -> float:
        """FLOPs over seconds of these GEMMs' three passes at micro-batches of `tokens`, each `weight` times."""
        shapes = tuple((max(1, round(tokens * g.share)), g.k, g.n, weight) for g, weight in gemms)
        return GK.gemms_rate(shapes, GK.mamf(device, dt, peaks), sms, {"fp8": 1, "bf16": 2, "fp16": 2}.get(dt, 4),
                             bandwidth)

    def matmul_rates() -> tuple[float, float]:
        fp8_gemms = float8_gemms(m, layout)
        # each GEMM as often as the rank runs it: a block's per block, the output projection's on the last stage
        weighted = [(g, 0 if g in fp8_gemms else flops.blocks) for g in K.block_gemms(m, layout)]
        others = [*weighted, (K.head_gemm(m, layout), int(flops.last_stage))]
        return (rate(others, high) * rates.efficiency,
                rate([(g, 1) for g in fp8_gemms], "fp8") * rates.efficiency if fp8_gemms else 1.0)

    # once per GEMM shapes and counts on `rates` (what the settings of a layout's memory knobs share)
    matmul, matmul_fp8 = _memo(rates, ("matmul rates", config_key(m), layout.tp, layout.precision, tokens,
                                       flops.blocks, flops.last_stage), matmul_rates)
    efficiency = rates.efficiency
    # soft-capped scores (Gemma 2) run FlexAttention on a GPU (models/architecture.softcap_kernel), a fused
    # kernel that is priced as FlashAttention-2 (FlexAttention's own rate is not measured here)
    # and so do packed rows' (document_mask_kernel), at their samples' effective length
    # Attention sinks run the eager attention on every device: its matmuls priced as the math kernel's
    a = describe(m).attention
    kernel = "math" if a.sinks else "flash" if a.softcap or packed_rows(layout) else \
        attention_kernel(t.attention_backend, device)
    att_fwd, att_bwd = GK.attention_rates(kernel, attended_length(layout, t) // layout.cp,
                                          GK.mamf(device, "bf16", peaks))
    ew_fwd, ew_bwd = K.elementwise_bytes(m, layout, t)

    def seconds(total: float, fp8: float, att: float, attention_rate: float, elementwise: float) -> dict[str, float]:
        return {"matmul": (total - fp8 - att) / matmul + fp8 / matmul_fp8,
                "attention": att / (attention_rate * efficiency), "elementwise": elementwise / bandwidth}

    forward = seconds(flops.forward, flops.forward_fp8, flops.forward_attention, att_fwd, ew_fwd + casts_fwd)
    backward = seconds(flops.backward, flops.backward_fp8, flops.backward_attention, att_bwd, ew_bwd + casts_bwd)
    # The host launches each kernel in turn: where kernels are shorter than their launches, it sets the pace.
    launch_fwd, launch_bwd = (n * GK.LAUNCH_S for n in K.kernel_launches(m, layout))
    parts = {kind: forward[kind] + backward[kind] for kind in forward} | {"launches": launch_fwd + launch_bwd}
    matmul_flops = (flops.forward - flops.forward_attention) + (flops.backward - flops.backward_attention)
    return ComputeTime(max(launch_fwd, sum(forward.values())), max(launch_bwd, sum(backward.values())),
                       (casts_fwd + casts_bwd) / bandwidth, parts, matmul_flops / parts["matmul"])


def _device_optimizer_seconds(m: ModelConfig, layout: Layout, rates: Rates) -> float:
    """The device's optimizer step over the rank's shard. Measured profile: its fit; catalog: AdamW's
    traffic, ADAMW_BYTES_PER_PARAM, at the memory bandwidth."""
    if rates.profile is not None:
        return K.optimizer_seconds(rates.profile, m, layout) * K.concurrency_slowdown(rates.profile, rates.hw,
                                                                                       layout)[1]
    block, root = stage_params(m, layout)
    params = (layout.busiest_rank_blocks() * block + root) / layout.zero_shards
    return params * ADAMW_BYTES_PER_PARAM / rates.device.hbm_bytes_per_s


def _exposed_host_seconds(layout: Layout, rates: Rates, compute_s: float, exposed_s: float, share: float) -> float:
    """Host work on the critical path. On a CPU (measured profile: the parallel frameworks' part,
    trainfit.perf.kernels) all of it, time-shared like the compute. A GPU's host runs ahead of its
    kernels and of the collectives they wait on, so only what exceeds the device's compute and exposed
    communication: the profile's frameworks' part where `trainfit calibrate` measured one, else the
    engine's whole host side (perf/host_costs.py: rates.engine.host)."""
    if rates.profile is None:
        if rates.hw.gpu == "cpu":
            return 0.0
        return max(0.0, rates.engine.host.step_seconds(layout) - compute_s - exposed_s)
    host = K.host_overhead_seconds(rates.profile, layout)
    return host * share if rates.hw.gpu == "cpu" else max(0.0, host - compute_s - exposed_s)


def compute_time_s(m: ModelConfig, layout: Layout, t: TrainingConfig, hw: HardwareConfig,
                   rates: Rates | None = None) -> float:
    """The busiest rank's forward and backward compute per step (estimate_perf's compute_s), alone:
    part of the lower bounds plan/search.py computes before whole estimates. A model whose layers differ in
    their tensors: its kinds' weighted by their share of the layers, as estimate_perf's."""
    rates = rates or Rates.of(hw)
    kinds, of = layer_kinds(m), kind_of_layers(m)
    if len(kinds) > 1:
        return sum(of.count(k) / len(of) * compute_time_s(kind, layout, t, hw, rates) for k, kind in enumerate(kinds))
    compute = _busiest_rank(m, layout, t, hw, rates)[1]
    return compute.forward + compute.backward


_TRAINING_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(TrainingConfig)))
"""A TrainingConfig's field values (scalars), in order: with architecture.config_key, the memo's keys."""


def _memo(rates: Rates, key: tuple, compute: Callable[[], Any]) -> Any:
    """compute() once per key on `rates` (rates.memo)."""
    found = rates.memo.get(key)
    if found is None:
        found = rates.memo[key] = compute()
    return found


_BUT_OFFLOAD = operator.attrgetter(*(f.name for f in dataclasses.fields(Layout) if f.name != "offload"))
"""A Layout's fields but memory.offload's: the compute reads offload only through data_parallel (FSDP2's)."""
_BUT_DATA_PARALLEL = operator.attrgetter(*(f.name for f in dataclasses.fields(Layout)
                                          if f.name not in ("offload", "dp_replicate", "dp_shard", "zero_stage")))
"""...and but the data-parallel split and ZeRO stage, which a catalog GPU's compute reads only as the
data-parallel degree, data_parallel and whether the stage is 0, and under fp8-mixed whether it is 3
(weights gathered again in backward, in fp8) and its shards (fp8 all-gathers): _compute_key."""


def _compute_key(layout: Layout, rates: Rates) -> tuple:
    """What the busiest rank's compute reads of a layout: on a catalog GPU or the CPU (no profile) the
    settings of one mesh's data-parallel split and ZeRO stage that compute alike share it (the planner's
    lower bounds ask for every group of a mesh); a measured profile reads the layout more widely."""
    if rates.profile is not None:
        return _BUT_OFFLOAD(layout), layout.data_parallel
    fp8 = layout.precision == "fp8-mixed"  # (only fp8's casts read the stage and the shards beyond data_parallel)
    return (_BUT_DATA_PARALLEL(layout), layout.dp, layout.data_parallel, layout.zero_stage == 0,
            fp8 and layout.zero_stage == 3, fp8 and layout.zero_shards)


def _busiest_rank(m: ModelConfig, layout: Layout, t: TrainingConfig, hw: HardwareConfig, rates: Rates
                  ) -> tuple[RankFlops, ComputeTime]:
    """The busiest rank's FLOPs and compute time (a model whose layers are alike), once per _compute_key on
    `rates`: whatever a layout offloads (the planner times every offload setting of a layout: they compute
    alike), and on the catalog however it splits its data parallelism."""
    device = device_type(hw)

    def compute() -> tuple[RankFlops, ComputeTime]:
        flops = _rank_flops(m, layout, t, device)
        return flops, _compute_seconds(m, layout, t, rates, flops)

    key = ("compute", config_key(m), _TRAINING_FIELDS(t), _compute_key(layout, rates), device)
    return _memo(rates, key, compute)


def timed_collectives(m: ModelConfig, layout: Layout, t: TrainingConfig, rates: Rates
                      ) -> list[tuple[Collective, float]]:
    """Every collective a rank issues per step, with the time of one call (one link per group of mesh
    axes; on a measured link, the profile's fit for the collective when it has one: Rates.fits). Once
    per layout on `rates`: the list is shared, not to be changed."""
    return _memo(rates, ("collectives", config_key(m), _TRAINING_FIELDS(t), layout),
                 lambda: _timed_collectives(m, layout, t, rates))


def _timed_collectives(m: ModelConfig, layout: Layout, t: TrainingConfig, rates: Rates
                       ) -> list[tuple[Collective, float]]:
    links: dict[tuple[str, ...], Link] = {}
    timed = []
    for c in step_collectives(m, layout, t):
        link = links.get(c.axes)
        if link is None:
            link = links[c.axes] = rates.link(layout, c.axes)
        if link.name == "measured":
            link = rates.fits.get((c.kind, c.group_size), link)
        timed.append((c, collective_time(c.kind, c.nbytes, c.group_size, link)))
    return timed


def model_parallel_comm_s(m: ModelConfig, layout: Layout, t: TrainingConfig, hw: HardwareConfig,
                          rates: Rates | None = None) -> float:
    """Tensor, context and pipeline parallelism's traffic per step, all of it exposed (the module
    docstring's table) but what async TP may hide behind GEMMs (counted as none): the other part of
    those bounds."""
    rates = rates or Rates.of(hw)
    timed = timed_collectives(m, layout, t, rates)
    return sum(one * c.count for c, one in timed if c.purpose in ("tp", "cp", "pp") and not _hides_behind(c, rates))


def _hides_behind(c: Collective, rates: Rates) -> tuple[str, ...]:
    """The GEMMs a call runs beside in this engine: async TP's (Collective.overlaps, kept only under
    parallel.async_tp), and a re-gather's input-gradient GEMMs where the engine overlaps them
    (perf/engines.Engine.regather_overlaps_dgrad; trainfit's re-gathers are exposed)."""
    if c.tensor == "regathered":
        return c.overlaps if rates.engine.regather_overlaps_dgrad else ()
    return c.overlaps


def _overlapped(timed: list[tuple[Collective, float]], m: ModelConfig, layout: Layout, t: TrainingConfig,
                rates: Rates, matmul_flops_per_s: float) -> list[tuple[Collective, float]]:
    """`timed` with each call that runs beside GEMMs (_hides_behind) at what it leaves exposed. Async TP
    cuts the collective of C seconds and its GEMMs of G into tp chunks, one chunk moving while another
    multiplies: max(C, G) + min(C, G) / tp together (the chunk that fills or drains the pipeline runs
    alone), so C - G of the call shows where it is longer, and one chunk of the shorter always. A
    re-gather is launched before its group's input-gradient GEMMs (as many FLOPs as their forward) and
    waited on after them: C - G shows."""
    if not layout.async_tp and not (layout.regathers and rates.engine.regather_overlaps_dgrad):
        return timed
    tokens = layout.micro_batch_size * t.seq_len / layout.cp
    gemms = {g.name: g for g in [*K.block_gemms(m, layout), K.head_gemm(m, layout)]}
    out = []
    for c, one in timed:
        if hidden := _hides_behind(c, rates):
            flops = sum(2 * max(1, round(tokens * gemms[n].share)) * gemms[n].k * gemms[n].n for n in hidden)
            g = flops / matmul_flops_per_s
            one = max(0.0, one - g) if c.tensor == "regathered" else max(0.0, one - g) + min(one, g) / layout.tp
        out.append((c, one))
    return out


def _exposed(timed: list[tuple[Collective, float]], fwd_s: float, bwd_s: float, n_mb: int
             ) -> tuple[dict[str, float], float]:
    """Exposed seconds per kind (the module docstring's table), and the part that recurs every micro-batch."""
    exposed = dict.fromkeys(KINDS, 0.0)
    per_microbatch = 0.0
    gather = {"forward": 0.0, "backward": 0.0}  # one micro-batch's block all-gathers
    hidden_mb = dict.fromkeys(KINDS, 0.0)  # gradient reduction hidden behind each micro-batch's backward
    hidden_once = dict.fromkeys(KINDS, 0.0)  # ... behind the last micro-batch's backward only
    for c, one in timed:
        total = one * c.count
        if c.purpose in EXPOSED_PURPOSES or c.phase == "step" or (c.purpose == "fsdp_param" and c.unit == "root"):
            exposed[c.kind] += total
            per_microbatch += total if c.per_microbatch else 0.0
        elif c.purpose == "fsdp_param":
            gather[c.phase] += total / n_mb
        else:  # grad_sync: the root unit's last call, or DDP's last bucket, ends the backward
            last = one if c.unit in ("root", "buckets") else 0.0
            exposed[c.kind] += last
            if c.per_microbatch:
                hidden_mb[c.kind] += (total - last) / n_mb
            else:
                hidden_once[c.kind] += total - last
    fwd_mb, bwd_mb = fwd_s / n_mb, bwd_s / n_mb
    fwd_over = n_mb * max(0.0, gather["forward"] - fwd_mb)
    hidden_mb["all_gather"] += gather["backward"]
    every = sum(hidden_mb.values())
    bwd_over = (n_mb - 1) * max(0.0, every - bwd_mb)
    last_over = max(0.0, every + sum(hidden_once.values()) - bwd_mb)
    exposed["all_gather"] += fwd_over
    per_microbatch += fwd_over
    # What does not fit behind the backward is shared out in proportion to what was to be hidden.
    for kind in KINDS:
        if every:
            exposed[kind] += bwd_over * hidden_mb[kind] / every
        if last_over:
            exposed[kind] += last_over * (hidden_mb[kind] + hidden_once[kind]) / (every + sum(hidden_once.values()))
    per_microbatch += bwd_over
    return exposed, per_microbatch


def _offload(m: ModelConfig, layout: Layout, rates: Rates, fwd_s: float, bwd_s: float
             ) -> tuple[dict[str, float], float]:
    """({h2d, d2h, host_optimizer}: seconds per step, exposed seconds) of CPU offload (module docstring)."""
    if layout.offload == "none":
        return {}, 0.0
    block, root = stage_params(m, layout)
    layers, n_mb = layout.busiest_rank_blocks(), layout.num_microbatches
    blocks, root = layers * block / layout.zero_shards, root / layout.zero_shards  # this rank's shard
    master_b = 2 if layout.precision == "bf16-pure" else 4
    grad_b = precision_bytes(layout.precision)[1]
    link = rates.host
    rate = link.bytes_per_s if link else float("inf")  # on a CPU the host is the device: nothing moves
    h2d_fwd = (blocks + root) * master_b / rate
    h2d_bwd = blocks * master_b / rate if layout.zero_stage == 3 else 0.0
    d2h = (blocks + root) * grad_b / rate
    optimizer = ((blocks + root) * ADAMW_BYTES_PER_PARAM / HOST_MEMORY_BYTES_PER_S_PER_GPU if link
                 else _device_optimizer_seconds(m, layout, rates))  # on a CPU the host is the device
    fwd_mb, bwd_mb = fwd_s / n_mb, bwd_s / n_mb
    exposed = (n_mb * (max(0.0, h2d_fwd - fwd_mb) + max(0.0, h2d_bwd + d2h - bwd_mb))
               + root * grad_b / rate + optimizer)
    return {"h2d": n_mb * (h2d_fwd + h2d_bwd), "d2h": n_mb * d2h, "host_optimizer": optimizer}, exposed


def estimate_perf(m: ModelConfig, layout: Layout, t: TrainingConfig, hw: HardwareConfig,
                  rates: Rates | None = None, timed: list[tuple[Collective, float]] | None = None) -> PerfEstimate:
    """FLOPs, step time and its parts, tokens/s and MFU of one layout of a model on its hardware.
    A caller that times many layouts passes hw's `rates`, resolved once, and may pass `timed`:
    timed_collectives of a layout that differs from this one in memory knobs only, with the same
    collectives_key."""
    rates = rates or Rates.of(hw)
    if len(layer_kinds(m)) > 1:
        return _mixed_perf(m, layout, t, hw, rates)
    tokens_per_step = layout.global_batch_size * t.seq_len
    context = attended_length(layout, t)  # what attention's FLOPs follow (packed samples: their lengths)
    model_tok = F.training_flops_per_token(m, context, layout.adaptation)
    hardware_tok = F.hardware_flops_per_token(m, context, layout.activation_checkpointing, layout.ac_every_n_layers,
                                              adaptation=layout.adaptation,
                                              chunked_loss=layout.chunked_loss, ep=layout.ep)
    recompute_tok = (F.recompute_flops_per_token(m, context, layout.activation_checkpointing,
                                                 layout.ac_every_n_layers, layout.ep)
                     + F.loss_recompute_flops_per_token(m, layout.chunked_loss))
    rank_flops, compute = _busiest_rank(m, layout, t, hw, rates)
    fwd, bwd = rank_flops.forward, rank_flops.backward
    fwd_s, bwd_s, fp8_cast_s, nf4_dequant_s = compute.forward, compute.backward, compute.fp8_casts, compute.nf4_dequant
    compute_s = fwd_s + bwd_s
    optimizer_s = _device_optimizer_seconds(m, layout, rates) if layout.offload == "none" else 0.0  # else _offload's

    n_mb = layout.num_microbatches
    timed = timed if timed is not None else timed_collectives(m, layout, t, rates)
    comm = dict.fromkeys(KINDS, 0.0)
    for c, one in timed:
        comm[c.kind] += one * c.count
    # On a CPU, gloo's collectives run on the cores that compute: nothing hides behind compute.
    cover_fwd, cover_bwd = (0.0, 0.0) if hw.gpu == "cpu" else (fwd_s, bwd_s)
    exposed, per_microbatch = _exposed(_overlapped(timed, m, layout, t, rates, compute.matmul_flops_per_s),
                                       cover_fwd, cover_bwd, n_mb)
    exposed_s = sum(exposed.values())
    offload, offload_exposed_s = _offload(m, layout, rates, fwd_s, bwd_s)
    frac = bubble_fraction(layout.pp_schedule, layout.pp, n_mb, layout.pp_virtual_stages)
    # Ranks time-sharing cores: a rank idle in the bubble leaves its core to the others, whose work
    # fills it; only what exceeds that shows (module docstring).
    share = K.time_share(rates.profile, hw, layout) if rates.profile is not None else 1.0
    alone = compute_s / share
    bubble_s = max(0.0, frac * (alone + per_microbatch) - (compute_s - alone))
    host_s = _exposed_host_seconds(layout, rates, compute_s, exposed_s, share)
    step_s = compute_s + host_s + exposed_s + offload_exposed_s + bubble_s + optimizer_s

    peak = rates.peak(layout.precision)
    flops = {
        "model_flops_per_token": float(model_tok),
        "hardware_flops_per_token": float(hardware_tok),
        "model_flops_per_step": float(model_tok * tokens_per_step),
        "hardware_flops_per_step": float(hardware_tok * tokens_per_step),
        "recompute_flops_per_step": float(recompute_tok * tokens_per_step),
        "flops_per_rank_per_step": fwd + bwd,
    }
    time = {
        "step_time_s": step_s,
        "compute_s": compute_s,
        "fp8_cast_s": fp8_cast_s,
        "nf4_dequant_s": nf4_dequant_s,
        "compute_parts_s": compute.parts or {},
        "comm_s": comm,
        "exposed_comm_s": exposed_s,
        "exposed_comm_by_kind_s": exposed,
        "offload_s": offload,
        "exposed_offload_s": offload_exposed_s,
        "bubble_s": bubble_s,
        "exposed_host_s": host_s,
        "bubble_fraction": frac,
        "optimizer_s": optimizer_s,
        "num_microbatches": n_mb,
        "tokens_per_second": tokens_per_step / step_s,
        "mfu": flops["model_flops_per_step"] / (step_s * layout.world_size * peak),
        "hfu": flops["hardware_flops_per_step"] / (step_s * layout.world_size * peak),
    }
    return PerfEstimate(flops=flops, time=time, collectives=tuple(timed))


def _mixed_perf(m: ModelConfig, layout: Layout, t: TrainingConfig, hw: HardwareConfig, rates: Rates) -> PerfEstimate:
    """A model whose layers differ in their tensors (dense and MoE) timed as its layers' mix: each kind's
    model (architecture.layer_kinds, every layer of that kind) estimated, and every FLOP count, time and
    collective weighted by the kind's share of the layers. Exact for what adds up over blocks (FLOPs,
    traffic, a block's collectives); the overlaps (communication behind compute, the busiest pipeline
    stage) taken per kind. Tokens/s, MFU and HFU follow from the mixed step time."""
    kinds, of = layer_kinds(m), kind_of_layers(m)
    shares = [of.count(k) / len(of) for k in range(len(kinds))]
    parts = [estimate_perf(kind, layout, t, hw, rates) for kind in kinds]

    def mixed(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {key: mixed([v.get(key, 0.0) for v in values]) for key in values[0]}
        if isinstance(values[0], float):
            return sum(w * v for w, v in zip(shares, values, strict=True))
        return values[0]  # counts alike for every kind (num_microbatches)

    flops, time = mixed([p.flops for p in parts]), mixed([p.time for p in parts])
    step_s, peak = time["step_time_s"], rates.peak(layout.precision)
    time.update(tokens_per_second=layout.global_batch_size * t.seq_len / step_s,
                mfu=flops["model_flops_per_step"] / (step_s * layout.world_size * peak),
                hfu=flops["hardware_flops_per_step"] / (step_s * layout.world_size * peak))
    collectives = tuple((c._replace(count=c.count * w), one) for part, w in zip(parts, shares, strict=True)
                        for c, one in part.collectives)
    return PerfEstimate(flops=flops, time=time, collectives=collectives)
