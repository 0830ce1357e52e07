"""What one rank's compute costs on a measured hardware profile (hardware.profile), and the
elementwise bytes a catalog GPU's step moves too (trainfit.perf.gpu_kernels prices the rest there).
Torch-free.

A profile (`trainfit calibrate`) measured each kind of work, so each is priced on its own
(trainfit.perf.timing adds them up):
- matmuls: every GEMM a block and the output projection run (m tokens x k by k x n), forward and
  its two backward products (input and weight gradients), each at the rate measured for that pass
  at the nearest shape of its dtype (nearest in log space over m, k, n; fp8-mixed: its float8
  linears at fp8's shapes, the rest at bf16's, torchao's casts with the elementwise work);
- attention: its FLOPs (trainfit.perf.flops: causal half, fused backward) at the rate measured for
  causal scaled_dot_product_attention of the nearest (sequence, head dim); profiles written before
  attention was measured price it at the matmul rate;
- elementwise work: the bytes eager PyTorch moves through memory for norms, RoPE, activations,
  residual adds, the loss's softmax and dtype casts, over the measured memory bandwidth (below);
- the optimizer step: the measured fit, step_s + s_per_param x the parameters the rank steps;
- ranks computing at once: a machine's ranks share its caches, memory bandwidth and cores, so each
  computes slower than one alone: GEMMs and attention by the matmul fraction the profile measured
  at that many ranks, elementwise work and the optimizer by the bandwidth fraction. calibrate runs
  its probe on all ranks in step, each batch as long as its slowest rank's: ranks time-sharing
  cores rotate, and one that waits (a collective, a pipeline bubble) leaves its core to the others,
  so beyond the cores this is the machine's throughput shared out. A world size not
  measured takes the contention measured at as many ranks as fill the cores, times ranks x threads
  over the cores (4 one-thread ranks on 2 cores: 2x). Collectives were measured as the ranks share
  the machine.

Elementwise bytes. Each count is elements read plus written per token, forward and backward, as a
byte counter at the dispatcher counts them over our Llama block (tests/estimator/test_kernels.py
recounts them within 10%, fp32 and bf16-mixed). The residual stream and the norms' elements are
4 bytes where the stream is fp32 (fp32, and the -mixed modes under autocast), else 2 (bf16-pure;
-mixed where FSDP2 or ZeRO-1 run the module in bf16); RoPE's and the MLP's are matmul outputs, in
the compute dtype; the loss runs in fp32:
- per block, ELEMENTWISE_D per model dimension: two RMSNorms (pow, mean, scale, weight, forward and
  backward) and two residual adds (forward, and their gradients' sums);
- per block, ELEMENTWISE_ROPE per query and key/value dimension: RoPE's products with cos and sin,
  rotate-half's negation and concatenation, their sum (9 forward), and their backward;
- per block, ELEMENTWISE_FFN per hidden unit of the MLP: SiLU (2) and the gate product (3) forward,
  SiLU's backward (3) and the product's (6);
- under training.compile (each block compiled), the block's counts are what its fused kernels read
  and write once (ELEMENTWISE_*_COMPILED); the output layer and the loss stay eager;
- once, ELEMENTWISE_HEAD_D per model dimension (the final norm) and ELEMENTWISE_LOSS_V per vocabulary
  entry (log-softmax 2, its backward 3, the loss's gather and its gradient's scatter 3);
- under autocast (the -mixed modes on one process or DDP), each weight is cast to the compute
  dtype per micro-batch (4 bytes read, 2 written) and its gradient cast back (2 read, 4 written),
  and so is each fp32 input of a Linear (AUTOCAST_INPUT_CASTS per block).
Tensor parallelism splits the RoPE and MLP parts over tp, and the norm and residual parts only with
sequence parallelism; activation checkpointing reruns the forward third of a wrapped block's.

Host work: tensor parallelism's DTensor dispatch (sharding propagation, to and from local tensors,
redistribution) runs in Python around every op of its modules, and FSDP2's hooks around every
unit (trainfit.calibrate.host): milliseconds per block forward and backward on a 2-core CPU,
whatever the block's size. The profile measures them per block and for the rest of the model; the
time model adds them to a CPU's step (the host is the device) and lets a GPU hide them behind the
kernels its host launches ahead.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

from trainfit.config import HardwareConfig, ModelConfig, TrainingConfig
from trainfit.models.architecture import describe
from trainfit.models.block_spec import BlockLinear, block_linears
from trainfit.parallel.layout import Layout
from trainfit.perf.comms import stage_params
from trainfit.perf.fp8_casts import float8_linears

if TYPE_CHECKING:
    from trainfit.hardware_profile import HardwareProfile

ELEMENTWISE_D = 83
ELEMENTWISE_ROPE = 24
ELEMENTWISE_FFN = 14
ELEMENTWISE_D_COMPILED = 17
"""training.compile fuses a block's elementwise chains (inductor), so each reads its inputs and writes
its outputs once: forward, the attention norm (x in, normed out: 2), the residual add fused with the
MLP norm (x and the attention's output in, the stream and normed out: 4), the last residual add (3);
backward, each norm's gradient fused with the residual gradient's sum (4 each)."""
ELEMENTWISE_ROPE_COMPILED = 4
"""Compiled RoPE: q and k read and written once forward (2), their gradients once backward (2)."""
ELEMENTWISE_FFN_COMPILED = 8
"""Compiled SwiGLU: gate and up in, product out (3); backward, both and the product's gradient in, their
gradients out (5)."""
ELEMENTWISE_HEAD_D = 31
ELEMENTWISE_LOSS_V = 8
FORWARD_SHARE = 1 / 3
"""Of a block's elementwise traffic, what its forward moves (backward moves about twice as much)."""
AUTOCAST_BYTES_PER_PARAM = 4 + 2 + 2 + 4
AUTOCAST_INPUT_CASTS = 5
"""fp32 inputs autocast casts per block: the attention norm's output for wq, wk and wv, the MLP norm's for w1, w3."""
AUTOCAST_BYTES_PER_ELEMENT = 4 + 2 + 2 + 4
"""Each cast forward (fp32 read, bf16 written) and its gradient's back."""


def _nearest_rate(measured: list[tuple[tuple[int, ...], float]], shape: tuple[int, ...]) -> float:
    """The rate measured at the shape nearest `shape` in log space."""
    def distance(point: tuple[int, ...]) -> float:
        return sum(abs(math.log(a / b)) for a, b in zip(point, shape, strict=True))

    return min(measured, key=lambda entry: distance(entry[0]))[1]


class Gemm(NamedTuple):
    """One forward GEMM of a block on one rank: (tokens share x k) @ (k x n)."""

    name: str
    """The Linear's name in the block (perf/fp8_casts.float8_linears' names); experts_*: routed experts."""
    k: int
    n: int
    share: float
    """The share of the micro-batch's tokens it multiplies."""


def block_gemms(m: ModelConfig, layout: Layout) -> list[Gemm]:
    """Each forward GEMM of one block on one rank, as models/block_spec.py describes and splits its
    linears: wq, wk, wv, wo, then the MLP (MoE: the router, each routed expert at its share of the
    tokens, the shared experts as one SwiGLU of their summed width; whole on every tp rank)."""
    return list(_block_gemms(block_linears(m), layout.tp))


@functools.lru_cache(maxsize=256)
def _block_gemms(linears: tuple[BlockLinear, ...], tp: int) -> tuple[Gemm, ...]:
    """block_gemms, once per block and tensor-parallel degree (the planner asks for it per layout)."""
    gemms: list[Gemm] = []
    for linear in linears:
        k, n = linear.local_shape(tp)
        gemms += [Gemm(linear.name, k, n, linear.token_share)] * linear.copies
    return tuple(gemms)


def float8_gemms(m: ModelConfig, layout: Layout) -> list[Gemm]:
    """The float8 linears' GEMMs of one block on one rank: block_gemms' shapes (after
    tensor parallelism: a column-parallel linear's n and a row-parallel one's k over tp), of the
    Linears float8_linears names; none outside fp8-mixed. The time model prices their casts, the
    analytic memory their backward's (memory/closed_form/analytic.py)."""
    if layout.precision != "fp8-mixed":
        return []
    converted = float8_linears(m)
    return [g for g in block_gemms(m, layout) if g.name in converted]


def head_gemm(m: ModelConfig, layout: Layout) -> Gemm:
    """The output projection's GEMM (on the last pipeline stage; vocabulary sharded over tp)."""
    return Gemm("output", m.dim, m.vocab_size // layout.tp, 1.0)


def matmul_rate(profile: HardwareProfile, dtype: str, m: ModelConfig, layout: Layout, tokens: int,
                gemms: list[Gemm] | None = None) -> float:
    """FLOPs over seconds of `gemms` (default: a block's and the output projection's), forward and
    backward, each pass at the rate measured for it at the nearest shape: the rate their FLOPs run at
    on this rank (micro-batches of `tokens`)."""
    forward = [((s.m, s.k, s.n), s.flops_per_s) for s in profile.matmul_shapes if s.dtype == dtype]
    backward = [b for b in profile.matmul_backward if b.dtype == dtype]
    passes = [forward,  # the input and weight gradients at their own rates, else (not measured) the forward's
              [((b.m, b.k, b.n), b.input_grad_flops_per_s) for b in backward] or forward,
              [((b.m, b.k, b.n), b.weight_grad_flops_per_s) for b in backward] or forward]
    if gemms is None:
        gemms = [*block_gemms(m, layout), head_gemm(m, layout)]
    flops = seconds = 0.0
    for _, k, n, share in gemms:
        rows = max(1, round(tokens * share))
        for measured in passes:
            flops += 2 * rows * k * n
            seconds += 2 * rows * k * n / _nearest_rate(measured, (rows, k, n))
    return flops / seconds


def attention_rate(profile: HardwareProfile, dtype: str, m: ModelConfig, seq_len: int) -> float | None:
    """The causal attention rate measured nearest (sequence, head dim), or None when it was not measured."""
    measured = [((a.seq_len, a.head_dim), a.flops_per_s) for a in profile.attention if a.dtype == dtype]
    return _nearest_rate(measured, (seq_len, describe(m).attention.head_dim)) if measured else None


def elementwise_bytes(m: ModelConfig, layout: Layout, t: TrainingConfig) -> tuple[float, float]:
    """(forward, backward incl. recomputation) bytes of elementwise work the busiest rank moves per step."""
    tp, sp = layout.tp, layout.tp if layout.sequence_parallel else 1
    stream, autocast = layout.stream_bytes, layout.autocast  # the residual stream's and the norms' element
    inner = 4 if layout.precision == "fp32" else 2  # what matmuls output: RoPE's and the MLP's elements
    attention = describe(m).attention
    ffn = m.ffn_dim if not m.num_experts else m.expert_ffn_dim * (m.experts_per_token + m.num_shared_experts)
    per_d, per_rope, per_ffn = ((ELEMENTWISE_D_COMPILED, ELEMENTWISE_ROPE_COMPILED, ELEMENTWISE_FFN_COMPILED)
                                if layout.compile else (ELEMENTWISE_D, ELEMENTWISE_ROPE, ELEMENTWISE_FFN))
    block = (per_d * m.dim / sp * stream + per_rope * (attention.q_dim + attention.kv_dim) / tp
             * inner + per_ffn * ffn / tp * inner
             + AUTOCAST_INPUT_CASTS * AUTOCAST_BYTES_PER_ELEMENT * m.dim / sp * autocast)
    head = ELEMENTWISE_HEAD_D * m.dim / sp * stream + ELEMENTWISE_LOSS_V * m.vocab_size / tp * 4
    policy = layout.activation_checkpointing

    def rank(layers: int, wrapped: int, last_stage: bool) -> tuple[float, float]:
        total = layers * block + head * last_stage
        rerun = 0 if policy == "none" else wrapped * block * FORWARD_SHARE
        return total * FORWARD_SHARE, total * (1 - FORWARD_SHARE) + rerun

    forward, backward = max((rank(*shape) for shape in layout.rank_shapes()), key=sum)
    tokens = layout.global_batch_size * t.seq_len / (layout.dp * layout.cp)
    casts = 0.0
    if autocast:
        block_params, root = _rank_params(m, layout)
        casts = (block_params + root) * AUTOCAST_BYTES_PER_PARAM * layout.num_microbatches
    return forward * tokens + casts / 2, backward * tokens + casts / 2


LAUNCHES_BLOCK = {"eager": (34, 65), "autocast": (50, 79), "compiled": (12, 21)}
"""Kernels one block launches, (forward, backward): eager as a dispatcher count of our Llama block
finds them (operators writing a new storage or an input in place; tests/estimator/test_kernels.py
recounts them within 10%), autocast's weight and input casts on top; compiled, its 7 linears' GEMMs
(3 each with backward), attention's 2 and the fused elementwise chains (4 forward, 6 backward)."""
LAUNCHES_REST = {"eager": (11, 20), "autocast": (14, 23), "compiled": (11, 20)}
"""... and the rest of the model once per micro-batch (embedding, final norm, output layer, loss): eager
either way, as training.compile compiles the blocks only."""


def kernel_launches(m: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(forward, backward incl. recomputation) kernels the busiest rank launches per step: its
    blocks' and, on the stage with the output layer, the rest's, every micro-batch (a checkpointed
    block launches its forward's again). A GPU's host launches them one at a time, so a step whose
    kernels are short waits on the host instead (trainfit.perf.timing)."""
    mode = "compiled" if layout.compile else "autocast" if layout.autocast else "eager"
    (block_fwd, block_bwd), (rest_fwd, rest_bwd) = LAUNCHES_BLOCK[mode], LAUNCHES_REST[mode]
    rerun = layout.activation_checkpointing != "none"

    def rank(layers: int, wrapped: int, last_stage: bool) -> tuple[float, float]:
        return (layers * block_fwd + rest_fwd * last_stage,
                layers * block_bwd + wrapped * block_fwd * rerun + rest_bwd * last_stage)

    forward, backward = max((rank(*shape) for shape in layout.rank_shapes()), key=sum)
    return forward * layout.num_microbatches, backward * layout.num_microbatches


def _rank_params(m: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(the busiest rank's blocks', its root unit's) parameters before ZeRO sharding."""
    block, root = stage_params(m, layout)
    return layout.busiest_rank_blocks() * block, root


def optimizer_seconds(profile: HardwareProfile, m: ModelConfig, layout: Layout) -> float:
    """One optimizer step of the parameters this rank steps (its ZeRO shard), from the measured fit
    (fused where it was measured; AdamW's fit stands for the other optimizers)."""
    blocks, root = _rank_params(m, layout)
    fit = min(profile.optimizer, key=lambda o: o.impl != "fused")
    return fit.step_s + fit.s_per_param * (blocks + root) / layout.zero_shards


def host_overhead_seconds(profile: HardwareProfile, layout: Layout) -> float:
    """Host work per step that the parallel frameworks add to the busiest rank, as the profile
    measured it at the group size nearest the layout's: DTensor's dispatch under tensor parallelism
    (with or without sequence parallelism; checkpointed blocks rerun their forward's share), and
    FSDP2's hooks under fully_shard; per block, and the rest of the model's on the rank that runs
    the output projection, every micro-batch. 0 for what was not measured."""
    frameworks = []  # (kind, group size, share a checkpointed block reruns)
    if layout.tp > 1:
        frameworks.append(("sequence_parallel" if layout.sequence_parallel else "tensor_parallel", layout.tp,
                           FORWARD_SHARE))
    if layout.data_parallel == "fsdp":  # a recomputed forward finds its unit's parameters gathered
        frameworks.append(("fully_shard", max(2, layout.zero_shards), 0.0))
    block = rerun = root = 0.0
    for kind, group, share in frameworks:
        measured = [h for h in profile.host_overhead if h.kind == kind]
        if measured:
            host = min(measured, key=lambda h: abs(math.log(h.ranks / group)))
            block, rerun, root = block + host.block_s, rerun + share * host.block_s, root + host.root_s
    checkpointed = layout.activation_checkpointing != "none"

    def rank(layers: int, wrapped: int, last_stage: bool) -> float:
        return layers * block + wrapped * rerun * checkpointed + root * last_stage

    return max(rank(*shape) for shape in layout.rank_shapes()) * layout.num_microbatches


def time_share(profile: HardwareProfile, hw: HardwareConfig, layout: Layout) -> float:
    """How many times over the node's ranks ask for its cores: ranks x threads / cores, at least 1."""
    ranks = min(layout.world_size, hw.gpus_per_node)
    return max(1.0, ranks * profile.machine.threads / profile.machine.cores)


def concurrency_slowdown(profile: HardwareProfile, hw: HardwareConfig, layout: Layout) -> tuple[float, float]:
    """(matmul, memory-bound) slowdown of each rank while the node's ranks compute at once, as the
    profile measured it at that many ranks; not measured there, the contention measured at as many
    ranks as fill the cores (else none), time-shared by the ranks beyond them (time_share)."""
    ranks = min(layout.world_size, hw.gpus_per_node)
    if ranks == 1:
        return 1.0, 1.0
    measured = next((c for c in profile.concurrency if c.ranks == ranks), None)
    if measured is not None:
        return 1 / measured.matmul, 1 / measured.bandwidth
    share = time_share(profile, hw, layout)
    filling = min(ranks, max(1, profile.machine.cores // profile.machine.threads))
    contended = next((c for c in profile.concurrency if c.ranks == filling), None)
    if contended is None:
        return share, share
    return share / contended.matmul, share / contended.bandwidth
