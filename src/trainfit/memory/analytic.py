"""Per-rank training memory in closed form: pure arithmetic on the config, no torch.

`estimate_memory(model, layout, training, hardware, optimizer)` returns one `MemoryBreakdown` per
pipeline stage (the figures of one rank of that stage) and the worst stage. The components are
their values at the step's peak moment, the largest of: the end of the model's forward, the loss,
the start of the backward, the backward of the stage's last and first block, and the optimizer
step (`phase_peaks` keeps the largest of each phase). tests/estimator/ checks them against measured steps of our models.
`StageMemory` gives them rank by rank (the planner stops at the first that does not fit), each
distinct rank once; `SharedSizes` keeps what the layouts of one model share.

Conventions (memory/breakdown.py's vocabulary; parallel/data_parallel.py's layouts and its table
of model-state forms per ZeRO stage):
- params: the tensors the rank computes with. fp32 / bf16-pure: the parameters (their FSDP shard
  at ZeRO-2/3), plus at ZeRO-2 the unsharded copies FSDP keeps from forward to backward.
  *-mixed: the 16-bit compute copies alive at the peak: with torch.amp (one process, DDP)
  autocast's weight casts, which autograd saves for backward (all of them at the end of the
  forward without checkpointing, the recomputed block's with it); under ZeRO-1 the replicated
  16-bit parameters (2Ψ, always); under FSDP2's MixedPrecisionPolicy (ZeRO 2/3) the gathered bf16
  parameters (ZeRO-2: all, from forward to backward; ZeRO-3: per block, reported as all-gather
  `buffers`).
- master_params: *-mixed only: the fp32 parameters the optimizer updates (torch.amp: the module's
  own parameters; FSDP2: their shard; ZeRO-1: its master shards, 4Ψ/N). Equal to what fp32
  reports as params, but for ZeRO-1, whose fp32 parameters are whole and its own masters.
- grads: those that exist at the peak: in the updated parameters' dtype (fp32 under *-mixed), but
  ZeRO-1's flat buffers in the parameters' dtype (optimizer.grad_accum_dtype='fp32': fp32) plus,
  in the optimizer step, its master shards' fp32 gradients (4Ψ/N). Where the gradients are
  buckets (DDP's, as `.grad` views: gradient_as_bucket_view; ZeRO-1's) they exist all step long.
- logits: logits, their fp32 copy, log-softmax and the logits' gradient (train/loss.py:
  `F.cross_entropy(logits.float(), ...)`), on the last stage; under memory.chunked_loss the model's
  output (the final hidden states) and one chunk's logits, log-softmax and gradients (`_logits`).
- buffers: FSDP all-gather / reduce-scatter buffers (ZeRO-1's collectives run in place in its
  gradient buffers: none), expert-parallel all-to-all buffers (in backward: activations.py's
  routed moments), optimizer-step temporaries, the
  recompute buffer of a checkpointed block (what it rebuilds in backward beyond what it kept),
  and module buffers (RoPE tables).
- memory.offload (FSDP2's CPUOffloadPolicy, either setting): the sharded parameters, their
  gradients (copied out after the reduce-scatter) and the optimizer states and step live on the
  host. On the device stay the unsharded compute copies (ZeRO-2: all of them from forward to
  backward; ZeRO-3: the current and prefetched block and the root), the unsharded gradients
  until their reduce-scatter, activations and logits.
- training.compile: the eager step's tensors (what inductor's partitioner saves instead follows its
  graph heuristics; benchmarks/compile.py measures the gap), but fp8-mixed's casts to fp8, which fuse
  into kernels that allocate only their fp8 output (FLOAT8_CAST_BYTES_COMPILED).

Also here: `model_states` (a rank's resident model states after backward), `forward_retained_bytes`
(what a micro-batch's forward leaves for its backward: the measurable activation figure) and
`zero_model_state_bytes` (the ZeRO paper's own accounting).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from trainfit.config import HardwareConfig, ModelConfig, OptimizerConfig, TrainingConfig
from trainfit.memory.activations import (
    FP32,
    ActDtypes,
    RoutedMoment,
    Routing,
    Terms,
    Transient,
    attention_backward_freed,
    backward_transient_terms,
    block_terms,
    context_parallel_mask_bytes,
    context_parallel_positions,
    final_norm_terms,
    head_weight_pass_pending_terms,
    moe_routing,
    policy_only_terms,
    routed_backward_moments,
    shared_experts_saved,
    stage_boundary_terms,
    weight_pass_pending_terms,
)
from trainfit.memory.breakdown import MemoryBreakdown
from trainfit.memory.comm_buffers import comm_buffer_bytes
from trainfit.models.block_spec import block_linears
from trainfit.models.params import ParamCounts, param_counts
from trainfit.parallel.engine import DDP_GRADIENT_AS_BUCKET_VIEW, FSDP_PREFETCH_BLOCKS, FSDP_REDUCE_BYTES_MIXED
from trainfit.parallel.layout import Layout
from trainfit.parallel.stage_split import SINGLE_STAGE_SCHEDULES, RankPlacement, checkpointed
from trainfit.perf.fp8_casts import float8_linears
from trainfit.perf.kernels import float8_gemms

MIB = 1024**2

CUDA_CONTEXT_BYTES = 500 * MIB
"""CUDA context and cuBLAS/cuDNN workspaces outside the caching allocator: 300-600 MiB on
A100/H100 with torch 2.x (nvidia-smi minus torch.cuda.memory_reserved). An assumption."""
ALLOCATOR_FRAGMENTATION = 0.08
"""Reserved-but-unallocated share of the CUDA caching allocator at the peak: 5-10% in steady-state
training memory snapshots. An assumption; 0 on CPU, where glibc's in-use bytes are the truth."""


def reserved_margin_terms(hardware: HardwareConfig, peak: int, comm_buffers: int) -> dict[str, int]:
    """The reserved margin's terms on a GPU, bytes: the CUDA context, the caching allocator's
    fragmentation at `peak`, NCCL's communicator buffers (memory/comm_buffers.comm_buffer_bytes).
    None on the CPU ({})."""
    if hardware.gpu == "cpu":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, "allocator_fragmentation": int(ALLOCATOR_FRAGMENTATION * peak),
            "comm_buffers": comm_buffers}


ADAM_STEP_TENSOR_BYTES = 4
"""torch.optim.Adam/AdamW keep `state["step"]` as a 0-dim fp32 tensor per parameter tensor
(torch/optim/adam.py with capturable=False; measured)."""
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adamw-8bit": 2, "adafactor": 1}
"""exp_avg and exp_avg_sq; SGD's momentum_buffer. torch creates them like the parameter
(`torch.zeros_like`), so they follow its dtype (bf16 under bf16-pure). adamw-8bit's two are 8-bit and
adafactor's one is factored (_optimizer_bytes prices both exactly); the counts are what a whole-size
state of each would be, for train/preflight's rough weights."""
FUSED_DEVICES = ("cuda", "cpu")
"""Devices with torch's fused Adam/AdamW kernel (torch/optim/adam.py, _get_fused_kernels_supported_devices);
train/optim.py runs it there unless optimizer.fused=false (`uses_fused_adam`)."""


def uses_fused_adam(optimizer: OptimizerConfig, device_type: str, sharded_loss_scaling: bool = False) -> bool:
    """Whether adamw / adam run torch's fused kernel (train/optim.py builds what this says; the step's
    temporaries follow it): optimizer.fused, or by default where FUSED_DEVICES have it, except under
    `sharded_loss_scaling` (Layout.sharded_loss_scaling: fp16-mixed under FSDP2 or a pipeline): torch's
    ShardedGradScaler hands the fused step a [1]-shaped inf flag that torch 2.13's fused kernel cannot
    take ("output with shape [] doesn't match the broadcast shape [1]", measured on CPU with ZeRO-2,
    ZeRO-3 and pp2), so those runs take foreach."""
    if optimizer.name not in ("adamw", "adam"):
        return False
    if optimizer.fused is not None:
        return optimizer.fused
    return device_type in FUSED_DEVICES and not sharded_loss_scaling
EIGHT_BIT_BLOCK = 256
"""adamw-8bit (torchao.optim.AdamW8bit, torchao/optim/subclass_8bit.py): each state is uint8 codes of
the parameter's (local) shape plus one fp32 absmax scale per block of this many values (torchao's
default, passed explicitly by train/optim.py), and a 256-entry fp32 code table per state tensor."""
EIGHT_BIT_MIN_SIZE = 4096
"""torchao keeps plain states (torch.zeros_like: the parameter's dtype) for a tensor whose local
shard has fewer values than this, or a number of values no multiple of EIGHT_BIT_BLOCK (adam.py's
_new_buffer)."""
EIGHT_BIT_TABLE_BYTES = 256 * 4
"""The code table (qmap) each 8-bit state tensor carries: 2**8 fp32 values."""
LOSS_PARALLEL_FP32_COPIES = (2, 4)
"""Under tp the logits stay sharded over the vocabulary into torch's loss_parallel (a rank holds
ceil(V / tp) columns), whose log-softmax and its backward are written out op by op
(torch/distributed/tensor/parallel/loss.py), not fused: inside the forward loss the shifted
logits and their exp exist beside the logits (2 fp32 shards where the fused kernel has 1); the
backward of nll + log-softmax holds the saved log-probabilities, the zeros-then-scatter gradient,
exp(log-probabilities) and their sum (4 fp32 shards where the fused backward has 3)."""

FLOAT8_CAST_BYTES = 9
"""Bytes per element while torchao 0.18 casts a tensor to fp8, eager (float8_training_tensor.
_ToFloat8ConstrFunc, float8_utils.to_fp8_saturated): `tensor.to(float32) * scale` (fp32; the bf16
input's fp32 copy is freed once multiplied), then its clamp (fp32) while the product is still
referenced, then the fp8 bits of the clamp: 4 + 4 + 1. The amax's abs() (the input's dtype) is freed
before. The same for tensorwise and rowwise scales (one fp32 per tensor, or per row: negligible)."""
FLOAT8_CAST_BYTES_COMPILED = 1
"""The same cast inside a block compiled by training.compile: inductor fuses its pointwise chain
(upcast, scale, clamp, fp8 conversion) into one kernel after the amax's reduction, so only its fp8
output is allocated (perf/fp8_casts.py prices the same fusion's traffic)."""

WEIGHT_PASS_SCHEDULES = frozenset({"interleaved-zero-bubble", "zbv-zero-bubble"})
"""Schedules whose backward is split into an input pass (I) and a later weight pass (W) at their
peak (torch's ScheduleDualPipeV splits only its cooldown, after its peak)."""

@dataclass(frozen=True)
class MemoryEstimate:
    per_stage: list[MemoryBreakdown]
    """One per pipeline stage (len 1 without pp); each the figures of one rank of that stage."""
    worst_stage: int
    """Index of the stage whose peak is largest."""

    @property
    def worst(self) -> MemoryBreakdown:
        return self.per_stage[self.worst_stage]


class _Run(NamedTuple):
    """The sections one estimate reads (references, never copies)."""

    model: ModelConfig
    layout: Layout
    training: TrainingConfig
    hardware: HardwareConfig
    optimizer: OptimizerConfig


@dataclass(frozen=True)
class _Precision:
    param: int
    """Bytes per element of the parameters the optimizer updates, and of their gradients."""
    compute: int
    mixed: bool
    act: ActDtypes


def _precision(mode: str, low_precision_model: bool) -> _Precision:
    """precision.py's modes. fp8-mixed's dtypes are bf16-mixed's (torchao's Float8Linear saves its bf16
    input and its high-precision weight, never their fp8 casts); what its float8 linears change is
    priced apart (_Layout.block_float8, _float8_backward_bytes). `low_precision_model`: under *-mixed
    the module's parameters are in the 16-bit dtype (FSDP2's MixedPrecisionPolicy, ZeRO-1)."""
    if mode == "fp32":
        return _Precision(4, 4, False, ActDtypes(4, 4, False))
    if mode == "bf16-pure":
        return _Precision(2, 2, False, ActDtypes(2, 2, False))
    # torch.amp (one process, DDP): fp32 residual stream, per-op casts. FSDP2's MixedPrecisionPolicy
    # and ZeRO-1 run the module itself in bf16 (autocast off): the activations are a bf16 model's.
    return _Precision(4, 2, True, ActDtypes(2, 2, False) if low_precision_model else ActDtypes(4, 2, True))


def assumed_attention_kernel(model: ModelConfig, layout: Layout, training: TrainingConfig,
                             hardware: HardwareConfig) -> str:
    """"fused" or "math": the SDPA kernel the estimate assumes (training.attention_backend). math
    when asked; a named fused kernel as asked (the trainer stops before training if it cannot run).
    auto follows torch's choice (aten/src/ATen/native/transformers): on CPU its flash kernel takes
    every dense float input (sdp_utils_cpp.cpp); on CUDA (cuda/sdp_utils.cpp) flash takes fp16/bf16
    with head dim <= 256 and no explicit mask (context parallelism passes one), the memory-efficient
    kernel fp32 too and masks, with head dim a multiple of 8 in 16 bits, 4 in fp32 (sm80 and later),
    and only what neither takes falls back to math."""
    backend = training.attention_backend
    if backend != "auto":
        return "math" if backend == "math" else "fused"
    if hardware.gpu == "cpu":
        return "fused"
    head_dim = model.dim // model.num_heads
    half = layout.precision != "fp32"
    if half and layout.cp == 1 and head_dim <= 256:
        return "fused"
    return "fused" if head_dim % (8 if half else 4) == 0 else "math"


class _Layout(NamedTuple):
    """What one rank of a pipeline stage holds: element counts after tp and ep."""

    blocks: int
    policy_blocks: int
    """Blocks the checkpointing policy wraps (global layer index divisible by ac_every_n_layers)."""
    last_wrapped: bool
    first_wrapped: bool
    in_flight: float
    """Micro-batches whose activations are alive at the peak (pipeline schedule)."""
    head_in_flight: int
    first: bool
    last: bool
    block: int
    block_matmul: int
    """Weights and biases of a block's Linears (what autocast casts; norms are not cast)."""
    block_float8: int
    """fp8-mixed: the elements of block_matmul in float8 Linears (perf/fp8_casts.float8_linears), which
    autocast does not cast (the weight goes to fp8 in the Linear, the bias to bf16, neither kept) and
    which FSDP2's float8 all-gather gathers in fp8; 0 otherwise."""
    block_experts: int
    """A block's routed-expert weights on the rank (its 1/ep of them): part of block_matmul."""
    block_no_decay: int
    mlp_out: int
    embedding: int
    head: int
    """Final norm, plus the output projection unless it is the embedding on this same rank."""
    output_matmul: int
    tied_here: bool
    tensors: int
    largest_tensor: int


def _in_flight(run: _Run, stage: int) -> tuple[float, int]:
    """Micro-batches of activations alive on pipeline rank `stage` at its peak (in units of one
    micro-batch through all of the rank's blocks), and of the head.

    gpipe runs every forward before any backward: m; looped-bfs too, one local stage after the
    other (Lamy-Poirier 2023, arXiv 2211.05953). 1F1B (Narayanan et al., arXiv 2104.04473): rank i
    keeps p - i. Interleaved 1F1B (Megatron's and torch.distributed.pipelining's warm-up): rank i
    runs (v - 1) p + 2 (p - 1 - i) chunk forwards before its first backward, so keeps that plus
    one chunk of its v: for rank 0, Korthikanti's L (1 + (p - 1)/(pv)) layers (arXiv 2205.05198,
    Sec. 4.2.3). Interleaved zero-bubble (torch's): a warm-up of (v - 1) p + (p - 1 - i) chunk
    forwards plus one, and i micro-batches whose weight gradients wait with their inputs saved:
    v p chunks, p micro-batches, on every rank. ZB-V (Qi et al., arXiv 2401.10241, Sec. 6): 1F1B's
    first-rank peak, p, on every rank (the V balances it). DualPipeV: torch's ScheduleDualPipeV
    order reaches 2p + 1 of the rank's chunks (its two stages) before its first backward, on every
    rank: p + 1/2 micro-batches (the DeepSeek-V3 report's "PP + 1" counts chunks of a DualPipe
    device, arXiv 2412.19437, Table 2). Zero-bubble micro-batches whose input pass has run keep
    their activations (retain_graph) until their weight pass: counted here, as the chunk orders
    show (tests/estimator/test_pipeline_memory.py walks torch's own orders).
    """
    layout = run.layout
    p, v, m, schedule = layout.pp, layout.pp_virtual_stages, layout.num_microbatches, layout.pp_schedule
    if p == 1:
        return 1.0, 1
    if schedule in ("gpipe", "looped-bfs"):
        return float(m), m
    if schedule == "interleaved-1f1b":
        return min(m * v, (v - 1) * p + 2 * (p - 1 - stage) + 1) / v, 1
    if schedule in ("interleaved-zero-bubble", "zbv-zero-bubble"):
        return float(min(p, m)), 1
    if schedule == "dualpipev":
        return min(2 * p + 1, 2 * m) / 2, 1
    return float(min(p - stage, m)), 1


def _float8_backward_bytes(k: int, n: int, tokens: int, casts_weight: bool, cast_bytes: int) -> int:
    """What one float8 Linear's backward allocates beyond its saved input and incoming gradient, at its
    largest moment (torchao 0.18, float8_linear.matmul_with_hp_or_float8_args.backward, whose locals
    live until it returns), for the rank's k -> n shard of it (perf/kernels.float8_gemms): the
    output gradient cast to fp8 for the input gradient (G8), the weight cast (unless FSDP2 gathered it
    in fp8), the input gradient (bf16), the output gradient cast again for the weight gradient, the
    input cast; each cast at `cast_bytes` per element while it runs (FLOAT8_CAST_BYTES eager,
    FLOAT8_CAST_BYTES_COMPILED compiled, where the kernels free what they no longer need: a bound).
    Moments: casting the weight, the second output-gradient cast, the input cast. The weight
    gradient's matmul comes after, with the casts' temporaries freed (bf16 weight gradient: <= what
    the input cast held)."""
    w = k * n if casts_weight else 0
    return max(tokens * n + cast_bytes * w,
               tokens * (n + 2 * k + cast_bytes * n) + w,
               tokens * (2 * n + 2 * k + cast_bytes * k) + w)


class _Block(NamedTuple):
    """A block's parameters on a rank (elements after tp and ep), and what sizes a rank's ends: the
    same on every pipeline rank of a layout (_Layout's block_* fields)."""

    params: int
    matmul: int
    float8: int
    experts: int
    no_decay: int
    mlp_out: int
    tensors: int
    """Parameter tensors of a block."""
    norm_tensors: int
    """Of the final norm, and of the embeddings (GPT-2 also has its learned positions)."""
    vocab: int
    """The embedding's and the output projection's elements on the rank."""
    largest: int
    """The largest tensor but those two."""


def _block(run: _Run, counts: ParamCounts) -> _Block:
    m, tp, ep = run.model, run.layout.tp, run.layout.ep
    # Each linear as tensor and expert parallelism split it (models/block_spec.py: an MoE
    # feed-forward whole on the tp ranks, its routed experts / ep; a row-parallel bias whole); norm
    # gains stay whole.
    linears = block_linears(m)
    matmul = sum(linear.local_params(tp, ep) for linear in linears)
    mlp = sum(linear.local_params(tp, ep) for linear in linears if linear.path.startswith("feed_forward."))
    head_dim = m.dim // m.num_heads
    if m.family == "gpt2":
        biases, tensors, mlp_out = 4 * m.dim + m.ffn_dim + m.dim, 16, m.dim * m.ffn_dim // tp
    else:
        biases = m.dim + 2 * m.num_kv_heads * head_dim if m.qkv_bias else 0
        tensors = 9 + (3 if m.qkv_bias else 0)  # 2 norms, wq wk wv wo, w1 w2 w3
        if m.num_experts:
            tensors += 1 + (3 if m.num_shared_experts else 0)  # router; shared w1 w2 w3
        mlp_out = mlp // 3
    experts_local = max(1, m.num_experts // ep) * (m.expert_ffn_dim or 0) * m.dim
    return _Block(
        params=matmul + counts.norms, matmul=matmul,
        float8=sum(k * n + b for k, n, b in float8_linears(m).values()) // tp
        if run.layout.precision == "fp8-mixed" else 0,
        experts=counts.routed_experts // ep, no_decay=counts.norms + biases // tp, mlp_out=mlp_out, tensors=tensors,
        norm_tensors=2 if m.family == "gpt2" else 1, vocab=m.vocab_size * m.dim // tp,
        largest=max(m.dim * m.dim // tp, m.ffn_dim * m.dim // tp, experts_local))


def _layout(run: _Run, common: _Common, place: RankPlacement) -> _Layout:
    m, mem, b = run.model, run.layout, common.block
    first, last, blocks = place.first, place.last, place.blocks  # blocks: global indices, model order
    n = mem.ac_every_n_layers
    policy_blocks = sum(checkpointed(i, n) for i in blocks) if mem.activation_checkpointing != "none" else 0
    tied_here = first and last and bool(m.tie_embeddings)
    head = common.counts.final_norm + (0 if tied_here else b.vocab) if last else 0
    tensors = len(blocks) * b.tensors + b.norm_tensors * first  # + pos embedding (gpt2)
    tensors += (b.norm_tensors + (0 if tied_here else 1)) * last
    in_flight, head_in_flight = _in_flight(run, place.rank)
    return _Layout(
        blocks=len(blocks), policy_blocks=policy_blocks,
        last_wrapped=policy_blocks > 0 and checkpointed(blocks[-1], n),
        first_wrapped=policy_blocks > 0 and checkpointed(blocks[0], n),
        in_flight=in_flight, head_in_flight=head_in_flight, first=first, last=last,
        block=b.params, block_matmul=b.matmul, block_experts=b.experts, block_float8=b.float8,
        block_no_decay=b.no_decay, mlp_out=b.mlp_out, embedding=common.counts.embedding // mem.tp if first else 0,
        head=head, output_matmul=b.vocab if last else 0, tied_here=tied_here, tensors=tensors,
        largest_tensor=max(b.vocab if (first or last) else 0, b.largest),
    )


def _rope_table_bytes(run: _Run) -> int:
    """Bytes per element of Llama's RoPE tables: fp32, bf16 once a bf16-pure model is cast."""
    return 2 if run.layout.precision == "bf16-pure" else FP32


def _optimizer_bytes(name: str, prec: _Precision, params: int, tensors: int, small: int,
                     matrices: list[tuple[int, ...]] = ()) -> int:
    """States of `params` elements held in `tensors` tensors; `small` elements are norms and
    biases (1-D), `matrices` the local shapes of the others (_matrix_shapes), which adamw-8bit and
    adafactor price tensor by tensor. Every Adam-like and Adafactor state has a 0-dim fp32 `step`
    per tensor (torch's and torchao's `torch.tensor(0.0)`)."""
    steps = ADAM_STEP_TENSOR_BYTES * tensors if name in ("adam", "adamw", "adamw-8bit", "adafactor") else 0
    if name == "adamw-8bit":
        eight_bit = sum(_eight_bit_state_bytes(prec, math.prod(shape)) for shape in matrices)
        return steps + eight_bit + 2 * small * prec.param
    if name == "adafactor":
        # torch/optim/_adafactor.py: >= 2-D: row_var (last dim 1) and col_var (second-to-last 1);
        # 1-D: a whole `variance`; all in the gradient's dtype (the updated parameters').
        factored = sum(math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] for shape in matrices)
        return steps + (factored + small) * prec.param
    return OPTIMIZER_STATES[name] * prec.param * params + steps


def _eight_bit_state_bytes(prec: _Precision, n: int) -> int:
    """adamw-8bit's two states of a tensor with `n` local values (EIGHT_BIT_* above)."""
    if n < EIGHT_BIT_MIN_SIZE or n % EIGHT_BIT_BLOCK:
        return 2 * n * prec.param
    return 2 * (n + FP32 * n // EIGHT_BIT_BLOCK + EIGHT_BIT_TABLE_BYTES)


def _matrix_shapes(run: _Run, lay: _Layout, shards: int) -> list[tuple[int, ...]]:
    """The >= 2-D parameters of a rank (train/optim.param_groups' decay group), as local shapes: after
    tp (column-parallel: rows / tp; row-parallel: columns / tp; vocabulary-parallel embedding and
    output), ep (routed experts: their first dim / ep) and ZeRO sharding over `shards` ranks, which
    splits dim 0 with torch.chunk (rank 0's, the largest chunk: ceil; routed experts over the edp
    ranks, shards / ep). The tp x ZeRO-sharded row-parallel weights take rows / shards of whole
    columns / tp (FSDP2's second mesh dimension)."""
    m, tp, ep = run.model, run.layout.tp, run.layout.ep
    block: list[tuple[int, ...]] = []
    experts: list[tuple[int, ...]] = []
    for linear in block_linears(m):  # each weight as tp splits it (models/block_spec.py), (out, in)
        k, n = linear.local_shape(tp)
        if linear.routed:
            experts.append((max(1, linear.copies // ep), n, k))
        else:
            block.append((n, k))
    vocab = (-(-m.vocab_size // tp), m.dim)
    ends = [vocab] * lay.first + [(m.max_seq_len, m.dim)] * (lay.first and m.family == "gpt2")
    ends += [vocab] * (lay.last and not lay.tied_here)

    def local(shape: tuple[int, ...], over: int) -> tuple[int, ...]:
        return (-(-shape[0] // over), *shape[1:])

    edp = max(1, shards // ep) if ep > 1 else shards
    return ([local(shape, shards) for shape in block] * lay.blocks + [local(shape, edp) for shape in experts]
            * lay.blocks + [local(shape, shards) for shape in ends])


# ---- expert parallelism (parallel/expert.py): the routed experts' ZeRO shards


def _on_shard(n: int, experts: int, shards: int, ep: int) -> int:
    """Elements of `n` on one of `shards` ZeRO shards (dp_shard x cp), where `experts` of them are
    routed experts already split over ep: FSDP2 shards those over the edp ranks (shards / ep) only,
    so expert states end divided by ep x edp, the rest by the shards (1: nothing sharded)."""
    if shards == 1:
        return n
    return (n - experts) // shards + experts * ep // shards


def _largest_sharded_group(run: _Run, lay: _Layout, decay: int, experts: int, shards: int) -> int:
    """The largest weight-decay layout group on a shard: _largest_layout_group's, and under expert
    parallelism the experts' (DTensors of their own mesh: a group apart)."""
    if run.layout.ep == 1:
        return _largest_layout_group(run, lay, decay) // shards
    dense = _largest_layout_group(run, lay, decay - experts) // shards
    return max(dense, _on_shard(experts, experts, shards, run.layout.ep))


# ---- end of expert parallelism


def _largest_layout_group(run: _Run, lay: _Layout, decay: int) -> int:
    """The largest of the optimizer's weight-decay groups (elements on the rank): one, unless tensor
    parallelism splits it by layout (train/optim.param_groups, data_parallel.group_by_layout), as
    torch's foreach kernels take one kind of tensor at a time: the column-parallel weights with the
    vocabulary-parallel embedding and output (Shard(0)), the row-parallel ones (Shard(1): wo, w2),
    and what no plan shards (an MoE feed-forward)."""
    tp, m = run.layout.tp, run.model
    if tp == 1:
        return decay

    def weights(style: str) -> int:  # a block's weights of one tensor-parallel style, on the rank
        return sum(math.prod(linear.local_shape(tp)) for linear in block_linears(m) if linear.tp == style)

    column = lay.blocks * weights("column") + lay.embedding + lay.output_matmul * (not lay.tied_here)
    row = lay.blocks * weights("row")
    return max(column, row, decay - column - row)


def _optimizer_step_temporaries(run: _Run, prec: _Precision, decay: int, largest: int,
                                matrices: list[tuple[int, ...]] = ()) -> int:
    """What the optimizer allocates inside step() (torch 2.13 / torchao 0.18 source, measured on CPU).
    Fused Adam/AdamW (`uses_fused_adam`): nothing. foreach Adam/AdamW:
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`, a state-sized list per parameter group
    (the largest is the weight-decay group); Adam's L2 decay first makes
    `grads = torch._foreach_add(grads, params, alpha=wd)`, deleted before the sqrt; foreach SGD with
    decay, the same copy. foreach Adafactor: `var_estimates = [row_var @ col_var ...]`, a
    parameter-sized list of the group, updated in place into the update. A single-tensor loop
    (foreach=False) holds all that for one tensor. adamw-8bit: torchao compiles each parameter's
    update; its kernel holds two fp32 buffers of the parameter's local shape and two of one value per
    block for a parameter with 8-bit states, nothing for plain states: on CUDA (triton's kernel
    assumed alike); on CPU inside one call no operator boundary sees (memory/traced.py's
    _eight_bit_update_as_compiled): 0."""
    o = run.optimizer
    if o.name == "adamw-8bit":
        if _device(run) == "cpu":
            return 0
        quantized = [n for n in map(math.prod, matrices) if _eight_bit_state_bytes(prec, n) < 2 * n * prec.param]
        return max((2 * FP32 * (n + n // EIGHT_BIT_BLOCK) for n in quantized), default=0)
    if uses_fused_adam(o, _device(run), run.layout.sharded_loss_scaling):
        return 0
    size = decay if o.foreach else largest
    l2_copy = size * prec.param if run.training.weight_decay > 0 and o.name in ("adam", "sgd") else 0
    sqrt = size * prec.param if o.name in ("adam", "adamw", "adafactor") else 0
    return max(sqrt, l2_copy) if o.foreach else sqrt + l2_copy


def _device(run: _Run) -> str:
    return "cpu" if run.hardware.gpu == "cpu" else "cuda"


class _Loss(NamedTuple):
    """The loss region's bytes on the last stage (the logits component)."""

    saved: int
    """What the loss saves for its backward beside the model's output (the log-probabilities;
    chunked: sequence parallelism's all-gathered hidden states)."""
    output: int
    """The model's output: the logits, or under memory.chunked_loss the final hidden states."""
    forward: int
    """Peak inside the loss's forward, the output included."""
    backward: int
    """Peak at the loss's backward, without the output."""
    keeps_output: bool = False
    """The loss holds the output through its backward (the chunked loss's checkpoint inputs)."""


def _logits(m: ModelConfig, prec: _Precision, shape: _Shape) -> _Loss:
    """train/loss.py's loss of one micro-batch of `tokens` tokens: logits (compute dtype) ->
    .float() (a copy unless fp32 already) -> cross_entropy = log_softmax (fp32, saved) + nll_loss.
    Backward starts with nll_loss's gradient (fp32) and log_softmax's input gradient while its
    output is still held: 3 fp32 logits (measured). Under tp, loss_parallel's unfused forms
    (LOSS_PARALLEL_FP32_COPIES) on a rank's vocabulary shard. Chunked: `_chunked_loss`."""
    tokens, tp = shape.tokens, shape.tp
    V = -(-m.vocab_size // tp)  # the largest shard: an uneven vocabulary's first ranks
    c = prec.act.compute
    copy = FP32 if c != FP32 else 0
    inside, backward = LOSS_PARALLEL_FP32_COPIES if tp > 1 else (1, 3)
    if shape.chunked_loss:
        return _chunked_loss(m, prec, shape, V, inside, backward)
    return _Loss(saved=FP32 * V * tokens, output=c * V * tokens, forward=V * tokens * (c + copy + inside * FP32),
                 backward=backward * FP32 * V * tokens)


def _chunked_loss(m: ModelConfig, prec: _Precision, shape: _Shape, V: int, inside: int, backward: int) -> _Loss:
    """memory.chunked_loss (train/loss.py): the model returns the final norm's output [tokens, D] in
    the stream's dtype, which the loss's checkpointed chunks keep as their inputs through its
    backward (under sequence parallelism its all-gathered, whole-sequence copy too). A chunk of q
    tokens then holds, in forward, its fp32 logits (the 16-bit ones are cast and dropped: nothing
    saves them) and log-softmax, and under tp loss_parallel's extra fp32 forms; in backward, the
    recomputed log-softmax and the two gradients (4 under tp), and under autocast the chunk's rows
    cast to the compute dtype, which the recomputed projection saves for its weight gradient. From
    the second chunk on, autograd also sums the chunks' gradients in its input buffers before
    passing them on: the output weight's (the matmul's dtype, one vocabulary shard) and the hidden
    states' (whole tokens: each chunk's slice gradient is full-size)."""
    D, act, tokens = m.dim, prec.act, shape.tokens
    sequence_parallel = shape.sequence_parallel
    output = Terms(seq=act.stream * D).bytes(tokens, 0, shape.tp, sequence_parallel)
    gathered = act.stream * D * tokens if sequence_parallel and shape.tp > 1 else 0
    chunk = min(tokens, shape.loss_chunk_tokens)
    sums = V * D * act.compute + tokens * D * act.stream if tokens > chunk else 0
    rows_cast = act.compute * D * chunk if act.autocast else 0
    return _Loss(saved=gathered, output=output, forward=output + gathered + (1 + inside) * FP32 * V * chunk,
                 backward=gathered + backward * FP32 * V * chunk + sums + rows_cast, keeps_output=True)


class _Stage(NamedTuple):
    """Everything one rank of a stage holds, before picking the peak moment."""

    lay: _Layout
    prec: _Precision
    params: int
    """Parameters (elements) on the rank before ZeRO sharding."""
    persistent: int
    """Bytes of the parameters the optimizer updates, resident on the device."""
    grads: int
    """Bytes of all resident gradients (ZeRO-1: its flat buffers)."""
    optimizer: int
    optimizer_temp: int
    fsdp: bool
    tokens: int
    seq: int
    compute_params: int = 0
    """ZeRO-1 under *-mixed: the replicated 16-bit parameters beside the fp32 master shards."""
    master_grads: int = 0
    """ZeRO-1: its master shards' gradients in the master dtype, from the reduce-scatter to the end
    of the step, when the buffers hold another dtype (else views of the buffers)."""


class _MicroBatch(NamedTuple):
    """One micro-batch's activation bytes that every pipeline rank of a layout has alike: a block's
    (saved, rebuilt by its recompute, made by its backward: activations.Transient's sizes), the
    head's and the loss's (on the rank of the last stage), a stage boundary's."""

    routing: Routing | None
    transient: Transient
    none: int
    """A block's saved activations without checkpointing..."""
    policy: int
    """...and under the checkpointing policy (the blocks it wraps)."""
    positions: int
    final: int
    loss: _Loss
    rebuild: int
    """What a checkpointed block recomputes in backward."""
    released: int
    """Saved by the policy, freed by the recompute."""
    released_last: int
    grad_stream: int
    grad_cast: int
    branch_grad: int
    attention: int
    mlp_new: int
    mlp_freed: int
    recompute_tail: int
    attention_freed: int
    """The math attention kernel's: what its backward finds freed (attention_backward_freed)."""
    boundary: int
    weight_pending: int
    head_weight_pending: int


class _Shape(NamedTuple):
    """What sizes a micro-batch's activations on a rank, besides the model and the dtypes."""

    tokens: int
    """Of the micro-batch on the rank (its local sequences)."""
    seq: int
    """The local sequence length."""
    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    policy: str
    """memory.activation_checkpointing."""
    moe_imbalance: float
    chunked_loss: bool
    loss_chunk_tokens: int
    rope_table_bytes: int


def _micro_batch(m: ModelConfig, prec: _Precision, shape: _Shape) -> _MicroBatch:
    act, policy, tp, cp = prec.act, shape.policy, shape.tp, shape.cp

    def size(terms: Terms) -> int:
        return terms.bytes(shape.tokens, shape.seq, tp, shape.sequence_parallel)

    routing = moe_routing(m, shape.tokens, shape.moe_imbalance, shape.ep)
    none = size(block_terms(m, act, "none", routing, cp, tp))
    wrapped = size(block_terms(m, act, policy, routing, cp, tp)) if policy != "none" else none
    t = backward_transient_terms(m, act, routing, shape.sequence_parallel, policy, cp)
    only = policy_only_terms(m, act, policy, tp, routing, cp)
    released = size(only.released)
    return _MicroBatch(
        routing=routing, transient=t, none=none, policy=wrapped,
        positions=size(context_parallel_positions(m, cp, shape.rope_table_bytes)),
        final=size(final_norm_terms(m, act, projected=not shape.chunked_loss)), loss=_logits(m, prec, shape),
        rebuild=none - wrapped + released + size(only.kept), released=released,
        released_last=size(only.released_last), grad_stream=size(t.grad_stream), grad_cast=size(t.grad_cast),
        branch_grad=size(t.branch_grad), attention=size(t.attention), mlp_new=size(t.mlp_new),
        mlp_freed=size(t.mlp_freed), recompute_tail=size(t.recompute_tail),
        attention_freed=size(attention_backward_freed(m, act)) if act.math_attention else 0,
        boundary=size(stage_boundary_terms(m, act)), weight_pending=size(weight_pass_pending_terms(m, act)),
        head_weight_pending=size(head_weight_pass_pending_terms(m, act)))


class SharedSizes:
    """What the memory estimates of one model's layouts share: its parameter counts, and a
    micro-batch's activation sizes by dtypes and shape (_Shape), each computed once. The planner's
    thousands of layouts have a few hundred shapes; pass one SharedSizes to the StageMemory of
    each (of this model only)."""

    def __init__(self, model: ModelConfig) -> None:
        self.model = model
        self.counts = param_counts(model)
        self._micro_batches: dict[tuple[_Precision, _Shape], _MicroBatch] = {}

    def micro_batch(self, prec: _Precision, shape: _Shape) -> _MicroBatch:
        if (prec, shape) not in self._micro_batches:
            self._micro_batches[prec, shape] = _micro_batch(self.model, prec, shape)
        return self._micro_batches[prec, shape]


class _Common(NamedTuple):
    """What every pipeline rank of a layout shares, computed once per estimate (the planner
    estimates thousands of layouts of up to 64 ranks each)."""

    counts: ParamCounts
    prec: _Precision
    fsdp: bool
    """ZeRO-2/3 and CPU offload are FSDP2 (offload moves the sharded parameters, their gradients
    and the optimizer to the host together); ZeRO-0 is DDP, ZeRO-1 parallel/zero.py's engine."""
    tokens: int
    """Tokens of one micro-batch on the rank (its local sequences)."""
    seq: int
    block: _Block
    micro_batch: _MicroBatch
    comm_buffers: int
    """NCCL's communicator buffers on any rank (memory/comm_buffers.py; 0 on the CPU)."""


def _common(run: _Run, shared: SharedSizes) -> _Common:
    layout = run.layout
    fsdp = layout.data_parallel == "fsdp"
    prec = _precision(layout.precision, not layout.autocast)
    if assumed_attention_kernel(run.model, layout, run.training, run.hardware) == "math":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, math_attention=True))
    seq = run.training.seq_len // layout.cp
    tokens = layout.micro_batch_size * seq
    shape = _Shape(tokens, seq, layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
                   layout.activation_checkpointing, layout.moe_imbalance, layout.chunked_loss, layout.loss_chunk_tokens,
                   _rope_table_bytes(run))
    return _Common(shared.counts, prec, fsdp, tokens, seq, _block(run, shared.counts), shared.micro_batch(prec, shape),
                   comm_buffer_bytes(run.layout, run.hardware))


PER_TENSOR_OPTIMIZERS = ("adamw-8bit", "adafactor")
"""Optimizers whose states are priced tensor by tensor (_matrix_shapes); the others never read the shapes."""


def _stage(run: _Run, common: _Common, lay: _Layout) -> _Stage:
    prec, fsdp, counts = common.prec, common.fsdp, common.counts
    if run.layout.data_parallel == "zero1":
        return _zero1_stage(run, common, lay)
    offload = run.layout.offload != "none"
    n = lay.blocks * lay.block + lay.embedding + lay.head
    no_decay = lay.blocks * lay.block_no_decay + (counts.final_norm if lay.last else 0)
    param_shards = run.layout.zero_shards if fsdp else 1
    state_shards = run.layout.zero_shards if run.layout.zero_stage >= 1 else 1
    experts, ep = lay.blocks * lay.block_experts, run.layout.ep
    resident = 0 if offload else _on_shard(n, experts, param_shards, ep) * prec.param
    matrices = _matrix_shapes(run, lay, state_shards) if run.optimizer.name in PER_TENSOR_OPTIMIZERS else []
    optimizer = 0 if offload else _optimizer_bytes(run.optimizer.name, prec, _on_shard(n, experts, state_shards, ep),
                                                   lay.tensors, no_decay // state_shards, matrices)
    temp = 0 if offload else _optimizer_step_temporaries(
        run, prec, _largest_sharded_group(run, lay, n - no_decay, experts, state_shards), lay.largest_tensor, matrices)
    return _Stage(lay, prec, n, resident, resident, optimizer, temp, fsdp, common.tokens, common.seq)


def _zero1_stage(run: _Run, common: _Common, lay: _Layout) -> _Stage:
    """ZeRO-1 (parallel/zero.py): parameters in the compute dtype, whole on every rank (2Ψ under
    *-mixed); flat gradient buffers in their dtype or fp32 (2Ψ or 4Ψ); master weights (fp32 under
    *-mixed, 4Ψ/N; otherwise the parameters' own rows) and optimizer states over N = dp_shard.
    Sharded terms are exact when N divides every dim 0 (the engine pads chunks to ceil(rows / N)).
    Its reduce-scatter and all-gather run in place in the gradient buffers: no bucket temporaries."""
    prec = common.prec
    n = lay.blocks * lay.block + lay.embedding + lay.head
    no_decay = lay.blocks * lay.block_no_decay + (common.counts.final_norm if lay.last else 0)
    shards = run.layout.zero_shards
    c = prec.act.compute  # the parameters' dtype: 16-bit under *-mixed and bf16-pure, else fp32
    grad = FP32 if run.layout.grad_accum_dtype == "fp32" else c
    master = prec.param  # fp32 masters under *-mixed; the parameters themselves otherwise
    params = n * c
    on_shard = _on_shard(n, lay.blocks * lay.block_experts, shards, run.layout.ep)
    matrices = _matrix_shapes(run, lay, shards) if run.optimizer.name in PER_TENSOR_OPTIMIZERS else []
    persistent = on_shard * master if prec.mixed else params
    return _Stage(lay, prec, n, persistent, n * grad,
                  _optimizer_bytes(run.optimizer.name, prec, on_shard, lay.tensors, no_decay // shards, matrices),
                  _optimizer_step_temporaries(run, prec, (n - no_decay) // shards, lay.largest_tensor // shards,
                                              matrices),
                  False, common.tokens, common.seq, compute_params=params if prec.mixed else 0,
                  master_grads=on_shard * master if grad != master else 0)


class _PipelineHeld(NamedTuple):
    """What torch.distributed.pipelining holds on one pipeline rank beyond its micro-batches' saved
    activations (bytes; all 0 without pp)."""

    slots: int = 0
    """Receive slots, all step long and across steps (buffers): stage.py's
    `_setup_forward_recv_info` allocates, for every non-first stage, one input buffer per
    micro-batch (`_make_tensor_from_meta`, m of them), and `_create_grad_recv_info` (through
    `_setup_backward_recv_info(num_microbatches)`) one output-gradient buffer per micro-batch for
    every non-last stage. Between two stages of one rank (the V schedules) `set_local_fwd_input` /
    `set_local_bwd_input` replace them with the neighbour's output / input gradient: m each still."""
    sent: int = 0
    """Stage outputs and input gradients at the peak that no slot holds (buffers): the outputs of
    the in-flight micro-batches (`fwd_cache`, until their backward); Schedule1F1B's `send_work`,
    which keeps its next-to-last warm-up forward's send (and so that output) until the cooldown;
    Schedule1F1B's last input gradient sent (its `bwd_sends` ops list); the runtime schedules'
    sent tensors (every schedule but stage_split.SINGLE_STAGE_SCHEDULES: torch runs them through
    _PipelineScheduleRuntime._step_microbatches, which keeps every SEND_F / SEND_B Work in one
    `send_ops` list until the step ends), at the end of the
    activation plateau: every forward sent, and the input gradients of the backwards done. The
    zero-bubble input pass also stores each input gradient in the input's `.grad`
    (stage_backward_input) until the next step's clear_runtime_states: the same tensor it sends."""
    pending: int = 0
    """Zero-bubble: the gradients the input pass keeps for the weight pass
    (activations.weight_pass_pending_terms), and on the last stage the head's saved activations,
    of the micro-batches awaiting their weight pass at the peak (activations)."""
    logits: int = 0
    """The last stage's output, the logits ([mb, T, V] in the compute dtype), of one micro-batch:
    the stage keeps it in `fwd_cache` from its forward, and backward_one_chunk in a local through
    its backward (logits; counted for every micro-batch in flight)."""


def _pipeline_held(run: _Run, lay: _Layout, place: RankPlacement, mb: _MicroBatch, head_saved: int, logits: int
                   ) -> _PipelineHeld:
    layout = run.layout
    if layout.pp == 1:
        return _PipelineHeld()
    p, v, m, n, schedule = layout.pp, layout.pp_virtual_stages, layout.num_microbatches, layout.num_stages, \
        layout.pp_schedule
    stage, boundary, cross_next, cross_prev = place.rank, mb.boundary, place.sends_next, place.sends_prev
    slots = m * boundary * place.boundaries
    # Chunks (one micro-batch through one local stage) awaiting their weight pass at the peak, in
    # torch's orders: interleaved zero-bubble rank i, i + 1; ZB-V, 1; they are the rank's later
    # stage's (its backward runs first).
    pending_chunks = 0
    if schedule in WEIGHT_PASS_SCHEDULES:
        pending_chunks = min(m, stage + 1 if schedule == "interleaved-zero-bubble" else 1)
    if schedule not in SINGLE_STAGE_SCHEDULES:  # torch's runtime schedules
        # At the end of the plateau every forward is done, and every backward (input pass) but
        # those of the chunks still alive.
        chunks_alive = lay.in_flight * v
        backwards_done = max(0.0, m * v - chunks_alive + pending_chunks)
        sent = (m * cross_next + backwards_done * cross_prev / v) * boundary
    else:
        sent = lay.in_flight * cross_next * boundary
        if schedule == "1f1b" and cross_next and min(m, p - stage) >= 2:
            sent += boundary
        if schedule == "1f1b" and m > 1:
            # Schedule1F1B's `bwd_sends` (the P2P ops of the last backward's send) keeps that input
            # gradient until the next backward replaces it.
            sent += cross_prev * boundary
    pending = 0
    if pending_chunks:
        later = place.stages[-1]
        blocks = layout.pp_layers[later]
        per_chunk = blocks * mb.weight_pending if later > 0 else 0
        if later == n - 1:
            per_chunk += mb.head_weight_pending + head_saved
        pending = pending_chunks * per_chunk
    return _PipelineHeld(int(slots), int(sent), int(pending), logits if lay.last else 0)


def _breakdown(run: _Run, common: _Common, lay: _Layout) -> Callable[[_PipelineHeld], MemoryBreakdown]:
    """A rank's breakdown, a pure function of what the ranks share and of its own (lay, pipe), as a
    function of what its pipeline schedule holds (pipe): ranks of one _Layout share all the rest."""
    st = _stage(run, common, lay)
    mb, prec, act, tp = common.micro_batch, st.prec, st.prec.act, run.layout.tp
    policy = run.layout.activation_checkpointing

    def size(terms: Terms) -> int:
        return terms.bytes(st.tokens, st.seq, tp, run.layout.sequence_parallel)

    # ---- activations of one micro-batch
    routing, transient, a_none, a_policy, rebuild = mb.routing, mb.transient, mb.none, mb.policy, mb.rebuild
    none_blocks = lay.blocks - lay.policy_blocks
    a_blocks = none_blocks * a_none + lay.policy_blocks * a_policy + mb.positions
    chunked = run.layout.chunked_loss
    a_final = mb.final if lay.last else 0
    loss = mb.loss if lay.last else _Loss(0, 0, 0, 0)

    # ---- compute copies, communication and module buffers
    c = prec.compute
    cast_block = c * (lay.block_matmul - lay.block_float8) if act.autocast else 0
    cast_head = c * lay.output_matmul if act.autocast else 0  # fp8-mixed: the output projection stays bf16
    # FSDP2 float8 all-gather: a block's float8 weights are gathered (and kept) in fp8, 1 byte each.
    fp8_gathered = lay.block_float8 * (c - 1) if run.layout.fp8_gathers else 0
    # ZeRO-2, and ZeRO-3 under a split-backward schedule (parallel/apply.py): reshard_after_forward=False
    kept_unsharded = st.fsdp and (run.layout.zero_stage == 2 or run.layout.splits_backward)
    held = c * st.params - lay.blocks * fp8_gathered if kept_unsharded else 0
    # ZeRO-3: FSDP2 never reshards the root (embeddings, final norm, output); every block reshards
    # after its forward, so blocks are gathered only while one runs (with its prefetched neighbour).
    zero3 = st.fsdp and not kept_unsharded
    root_gather = c * (lay.embedding + lay.head) if zero3 else 0
    block_gather = c * lay.block - fp8_gathered if zero3 else 0
    reduce = (FSDP_REDUCE_BYTES_MIXED if prec.mixed else prec.param) if st.fsdp else 0
    # Context parallelism's causal masks, and Llama's RoPE cos/sin tables
    persistent_buffers = context_parallel_mask_bytes(st.seq, run.layout.cp, act.compute)
    if run.model.family == "llama":
        head_dim = run.model.dim // run.model.num_heads
        persistent_buffers += 2 * run.model.max_seq_len * head_dim * _rope_table_bytes(run)
    kind = run.layout.data_parallel
    if kind == "ddp" and not DDP_GRADIENT_AS_BUCKET_VIEW:
        persistent_buffers += st.grads  # DDP's gradient buckets, beside the gradients
    # (and the pipeline's receive slots, all step long; the forward and backward buffers: its sends)
    fwd_buffers = persistent_buffers + root_gather
    # FSDP's unsharded gradients of the root (output projection, final norm; a tied embedding's
    # too), reduce-scattered when the backward ends; a block's own are in in_backward below.
    root_grads = lay.head + (lay.embedding if lay.tied_here else 0)
    bwd_buffers = persistent_buffers + root_gather + (c * root_grads if st.fsdp else 0)
    # ZeRO-3 in a block's backward: the block gathered, and the next one prefetched unless this is
    # the first block (the last to run); FSDP2 also holds the previous block's reduce-scatter input
    # until it issues the next one.
    last_comms = block_gather * (1 + FSDP_PREFETCH_BLOCKS)
    first_comms = block_gather + (reduce * lay.block if st.fsdp and lay.blocks > 1 else 0)
    # FSDP under a pipeline schedule: torch's stage runs every backward with gradient sync and
    # resharding after backward off (stage.py backward_maybe_with_nosync) and reduce-scatters once,
    # after the step's last micro-batch (perform_reduce_grad). Each unit's gradients accumulate
    # unsharded in the reduce dtype (FSDP2's unsharded_accumulated_grad) from its first backward,
    # and its parameters stay gathered after each backward until its next forward reshards them.
    pp_fsdp = st.fsdp and run.layout.pp > 1
    if pp_fsdp:
        first_comms = c * lay.blocks * lay.block if zero3 else 0  # every block backwarded: still gathered

    # ---- gradients present before this micro-batch's backward: accumulation or pipelining
    m = run.layout.num_microbatches
    accumulating = run.layout.grad_accum_steps > 1 if run.layout.pp == 1 else m > lay.in_flight
    # Gradients that are buckets (DDP's gradient_as_bucket_view, ZeRO-1's buffers) exist from the
    # step's start; autograd's gradient is moved into its bucket as soon as it is made, so nothing
    # else of a parameter's gradient outlives its own backward.
    bucketed = kind == "zero1" or (kind == "ddp" and DDP_GRADIENT_AS_BUCKET_VIEW)
    before = st.grads if accumulating or bucketed else 0
    # FSDP under a pipeline schedule: no sharded gradient exists before the step's reduce-scatter;
    # the accumulated unsharded ones do, those of the blocks already backwarded in this micro-batch,
    # or of all of them once a micro-batch is done: the parameters' own `.grad` (grads) when they
    # are in the reduce dtype, else FSDP2's reduce-dtype copy (buffers, as its other staging).
    accumulated = reduce * st.params if pp_fsdp and accumulating else 0
    if pp_fsdp:
        before = 0 if prec.mixed else accumulated
        if prec.mixed:
            fwd_buffers += accumulated
            bwd_buffers += accumulated
    # Bytes per element of the gradients autograd makes (the module's parameters' dtype) and of
    # those held in `.grad` until the step (none beyond the buckets when bucketed).
    autograd_bytes = c if st.fsdp or kind == "zero1" else st.grads / st.params if st.params else 0
    per_param = 0 if bucketed else st.grads / st.params if st.params else 0
    # A tied weight's gradient stays in autograd's accumulation buffer until the embedding's
    # backward adds its share (FSDP2 reduces it as an unsharded gradient, in bwd_buffers).
    tied_pending = int(lay.embedding * autograd_bytes) if lay.tied_here and not st.fsdp else 0
    # Sharded gradients (FSDP) exist once reduce-scattered: the root's after the whole backward.
    output_grads = 0 if st.fsdp or bucketed else int(root_grads * per_param) - tied_pending
    later = st.params - lay.block - (0 if lay.tied_here else lay.embedding) - (root_grads if st.fsdp else 0)
    later_grads = 0 if bucketed else int(later * per_param) - tied_pending
    if pp_fsdp and not accumulating:
        if prec.mixed:
            first_comms += reduce * (later + root_grads)
        else:
            later_grads = reduce * (later + root_grads)
    # The MLP's output matmul (w2 / fc2) has its weight gradient by the MLP's backward peak: in
    # .grad after SwiGLU's w2 (under FSDP an unsharded gradient, until the block's reduce-scatter);
    # GELU's peak is inside fc2's backward, where under autocast the 16-bit weight gradient is not
    # yet cast and accumulated. Bucketed, the peak is w2's own backward: its weight gradient, just
    # made (an activation gradient until the bucket's hook takes it), beside its input's gradient.
    w2_in_flight = run.model.family == "gpt2" and act.autocast
    w2 = (0, 0, c * lay.mlp_out) if w2_in_flight else (0, c * lay.mlp_out, 0) if st.fsdp else \
        (0, 0, int(autograd_bytes * lay.mlp_out)) if bucketed else (int(lay.mlp_out * per_param), 0, 0)
    # MoE: the shared experts' backward runs first (mlp_* of `transient`; their w2 for w2), then the
    # routed experts' (activations.routed_backward_moments); the routed output is in the stream's
    # dtype, so no grad_cast then.
    routed_moments: list[RoutedMoment] = []
    shared_kept = shared_rebuilt = 0
    if routing is not None:
        m = run.model
        shared_w2 = m.num_shared_experts * m.expert_ffn_dim * m.dim
        w2 = (0, c * shared_w2, 0) if st.fsdp else (0, 0, int(autograd_bytes * shared_w2)) if bucketed else \
            (int(shared_w2 * per_param), 0, 0)
        routed_moments = routed_backward_moments(
            m, act, transient, routing, size, expert_weight=common.counts.routed_experts // 3 // run.layout.ep,
            grad_bytes=c if st.fsdp else autograd_bytes, num_local_experts=m.num_experts // run.layout.ep,
            policy=policy)
        shared_kept, shared_rebuilt = (size(t) for t in shared_experts_saved(m, act, policy))

    def routed(done: int) -> tuple[int, int]:
        """(grads, buffers) of `done` gradient elements (FSDP: unsharded compute copies, buffers)."""
        return (0, c * done) if st.fsdp else (int(done * per_param), 0)

    # fp8-mixed: the largest float8 backward's own allocations (_float8_backward_bytes), at the start
    # of the block's backward (its saved activations all there): the MLP's output Linear (w2) or the
    # attention's (wo), the first of each branch to run backward. MoE: wo and the shared experts' w2.
    # Their incoming gradient is the branch's: with sequence parallelism the all-gathered one.
    float8 = {g.name: g for g in float8_gemms(run.model, run.layout)} if lay.block_float8 else {}
    cast_bytes = FLOAT8_CAST_BYTES_COMPILED if run.layout.compile else FLOAT8_CAST_BYTES
    fp8_backward = max((_float8_backward_bytes(float8[name].k, float8[name].n, st.tokens, not run.layout.fp8_gathers,
                                               cast_bytes) for name in ("w2", "wo", "shared_w2") if name in float8),
                       default=0)

    def in_backward(wrapped: bool) -> tuple[int, int, int, int]:
        """(grads, buffers, activations, 16-bit casts) a block adds at its backward's peak.
        Unwrapped: its saved activations with the attention's or the MLP's gradients. Checkpointed:
        the recompute just done, or the MLP's gradients (by the attention's turn the MLP's recompute
        is freed). MoE: or a moment of the routed experts' backward."""
        # With sequence parallelism the branch's cast is all-gathered (branch_grad) and freed.
        stream, cast = mb.grad_stream + tied_pending, 0 if run.layout.sequence_parallel else mb.grad_cast
        incoming = mb.branch_grad if run.layout.sequence_parallel else cast  # a branch's output gradient
        # The math attention kernel's backward (S²-sized gradients) comes after the MLP's and the
        # output projection's, whose saved (or rebuilt) tensors are freed by then.
        freed = mb.attention_freed
        attention = (w2[0], w2[1], a_none - freed + stream + cast + mb.attention, 0)
        if not wrapped:
            mlp = mb.mlp_new - mb.mlp_freed
            fused_attention = 0 if act.math_attention else mb.attention
            moments = [(w2[0], w2[1], a_none + stream + cast + max(fused_attention, mlp + w2[2]), 0)]
            moments += [attention] if act.math_attention else []
            if fp8_backward:  # before any of the block's weight gradients exists
                moments.append((0, 0, a_none + stream + incoming + fp8_backward, 0))
            for r in routed_moments:
                acts = a_none - shared_kept - shared_rebuilt - r.freed + stream + r.added
                moments.append((*routed(r.done), acts, -r.uncast))
            return max(moments, key=sum)
        kept = a_policy - mb.released + stream
        recomputed = (0, rebuild + mb.recompute_tail, kept + mb.branch_grad + mb.released_last, 0)
        mlp_moment = (w2[0], w2[1] + rebuild - mb.mlp_freed, kept + cast + mb.mlp_new + w2[2], 0)
        moments = [recomputed, mlp_moment]
        if fp8_backward:
            moments.append((0, rebuild, kept + incoming + fp8_backward, 0))
        if act.math_attention:  # the kept tensors and the recompute's, less what the MLP's backward freed
            moments.append((w2[0], w2[1] + max(0, rebuild - freed), kept + cast + mb.attention, 0))
        for r in routed_moments:
            grads, buffers = routed(r.done)
            acts = kept - shared_kept + r.added - r.freed_kept
            moments.append((grads, buffers + rebuild - shared_rebuilt - (r.freed - r.freed_kept), acts, -r.uncast))
        return max(moments, key=sum)

    last_grads, last_buffers, last_acts, last_casts = in_backward(lay.last_wrapped)
    first_grads, first_buffers, first_acts, first_casts = in_backward(lay.first_wrapped)

    head_grad = 0
    if bucketed and lay.last and not chunked:
        head_grad = int(autograd_bytes * lay.output_matmul) + (c * lay.output_matmul if act.autocast else 0)

    n_if, h_if = lay.in_flight, lay.head_in_flight
    older_own = (n_if - 1) * a_blocks + (h_if - 1) * a_final  # other micro-batches in flight
    # Autocast caches one cast per parameter for its whole block, and a pipeline step runs every
    # micro-batch in one (Trainer.pipeline_forward_backward): the other micro-batches add none.
    # Its backward runs inside the block too, where one process's runs after it: every cast stays.
    saved_casts = none_blocks * cast_block + cast_head
    all_casts, pipelined = lay.blocks * cast_block + cast_head, run.layout.pp > 1
    states = st.persistent + st.optimizer + st.compute_params

    def with_pipeline(pipe: _PipelineHeld) -> MemoryBreakdown:
        older = older_own + pipe.pending
        # The pipeline's last stage holds each in-flight micro-batch's logits (the current one's
        # through its backward too), where one process frees them once the loss is computed, and what
        # its loss saved (the loss region's: logits).
        older_logits, own_logits = (h_if - 1) * (pipe.logits + loss.saved), pipe.logits
        # The chunked loss holds the output through its own backward (one process: only then).
        loss_bwd = loss.backward + (loss.output if loss.keeps_output and not own_logits else 0)
        fwd, bwd = fwd_buffers + pipe.slots + pipe.sent, bwd_buffers + pipe.slots + pipe.sent
        acts = older + a_blocks + a_final
        moments = [  # (phase, params: compute copies, activations, logits, grads, buffers)
            # End of the model's forward: autocast's cache still holds checkpointed blocks' casts.
            ("forward", held + all_casts, acts, older_logits + loss.output, before, fwd),
            ("forward", held + saved_casts, acts, older_logits + loss.forward, before, fwd),
            ("backward", held + saved_casts, acts, older_logits + own_logits + loss_bwd, before, fwd),
            # Bucketed gradients: the output projection's backward, its weight gradient just made
            # (under autocast also its 16-bit form) beside the logits' gradient in the compute dtype,
            # until the bucket's hook takes it (a large vocabulary makes this the backward's peak).
            *([("backward", held + saved_casts, acts + head_grad, older_logits + max(own_logits, loss.output),
                before, fwd)] if head_grad else []),
            ("backward", held + (all_casts if pipelined else saved_casts - cast_head
                                 + (cast_block if lay.last_wrapped else 0)) + last_casts,
             older + a_blocks - (a_policy if lay.last_wrapped else a_none) + last_acts, older_logits + own_logits,
             max(before, output_grads + last_grads), bwd + last_comms + last_buffers),
            # (under a pipeline schedule FSDP keeps every backwarded block gathered: all of them, held)
            ("backward", (held if pp_fsdp else c * (lay.block + lay.embedding + lay.head) if held else 0)
             + (all_casts if pipelined else cast_block) + first_casts,
             older + first_acts, older_logits + own_logits, max(before, later_grads) + first_grads,
             bwd + first_comms + first_buffers),
            # The step: every gradient (ZeRO-1's master gradients too) and the optimizer's temporaries.
            ("optimizer", 0, 0, 0, st.grads + st.master_grads, persistent_buffers + pipe.slots + st.optimizer_temp),
        ]
        phase_peaks: dict[str, int] = {}
        at, peak = moments[0], -1
        for moment in moments:
            total = states + int(sum(moment[1:]))
            phase_peaks[moment[0]] = max(phase_peaks.get(moment[0], 0), total)
            if total > peak:
                at, peak = moment, total
        phase, copies, activations, logits, grads, buffers = at
        terms = reserved_margin_terms(run.hardware, peak, common.comm_buffers)
        return MemoryBreakdown(
            params=int(copies) + st.compute_params + (0 if prec.mixed else st.persistent),
            master_params=st.persistent if prec.mixed else 0,
            grads=int(grads), optimizer=st.optimizer, activations=int(activations), logits=int(logits),
            buffers=int(buffers), peak=peak, peak_phase=phase, reserved_margin=sum(terms.values()), margin_terms=terms,
            phase_peaks=phase_peaks,
        )

    return with_pipeline


class StageMemory:
    """The breakdowns of one layout's pipeline ranks, each when asked: what the ranks share is
    computed once, then a rank's own shape (_Layout: its blocks and ends; _PipelineHeld: what its
    schedule holds), and each distinct shape once (ranks alike have equal breakdowns; ranks of one
    _Layout differ only in what the pipeline holds). The planner asks the ranks one by one and
    stops at the first that does not fit (plan/search.py)."""

    def __init__(self, model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                 optimizer: OptimizerConfig, shared: SharedSizes | None = None) -> None:
        if shared is not None and shared.model is not model:
            raise ValueError("StageMemory: `shared` holds another model's sizes")
        self._run = _Run(model, layout, training, hardware, optimizer)
        self._common = _common(self._run, shared or SharedSizes(model))
        self._layouts: dict[_Layout, Callable[[_PipelineHeld], MemoryBreakdown]] = {}
        self._shapes: dict[tuple[_Layout, _PipelineHeld], MemoryBreakdown] = {}

    def __call__(self, stage: int) -> MemoryBreakdown:
        """The breakdown of a rank of pipeline stage (pp rank) `stage`."""
        run, common, mb = self._run, self._common, self._common.micro_batch
        place = run.layout.rank_placement(stage)
        lay = _layout(run, common, place)
        pipe = _pipeline_held(run, lay, place, mb, mb.final + mb.loss.saved, mb.loss.output)
        shape = (lay, pipe)
        if shape not in self._shapes:
            if lay not in self._layouts:
                self._layouts[lay] = _breakdown(run, common, lay)
            self._shapes[shape] = self._layouts[lay](pipe)
        return self._shapes[shape]


def estimate_memory(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                    optimizer: OptimizerConfig) -> MemoryEstimate:
    """Per-rank memory of one training step, one breakdown per pipeline stage. Pure: the planner
    calls it for thousands of layouts of one config without copying anything."""
    memory = StageMemory(model, layout, training, hardware, optimizer)
    stages = [memory(s) for s in range(layout.pp)]
    worst = max(range(len(stages)), key=lambda i: stages[i].peak)
    return MemoryEstimate(per_stage=stages, worst_stage=worst)


def _rank(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
          optimizer: OptimizerConfig, stage: int) -> tuple[_Run, _Common, _Stage]:
    run = _Run(model, layout, training, hardware, optimizer)
    common = _common(run, SharedSizes(model))
    return run, common, _stage(run, common, _layout(run, common, layout.rank_placement(stage)))


def model_states(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                 optimizer: OptimizerConfig, stage: int = 0) -> MemoryBreakdown:
    """The resident model states of a rank of `stage` when its optimizer is about to step: params
    (the updated parameters under fp32 / bf16-pure: their shard under FSDP, which reshards ZeRO-2's
    unsharded copies after each block's backward; ZeRO-1's replicated 16-bit ones under *-mixed),
    master_params (*-mixed), all gradients (ZeRO-1: its buffers and its master shards' gradients),
    optimizer states. What the rank's tensors add up to then (Trainer's state_bytes)."""
    _, _, st = _rank(model, layout, training, hardware, optimizer, stage)
    return MemoryBreakdown(params=st.compute_params + (0 if st.prec.mixed else st.persistent),
                           master_params=st.persistent if st.prec.mixed else 0,
                           grads=st.grads + st.master_grads, optimizer=st.optimizer)


def forward_retained_bytes(model: ModelConfig, layout: Layout, training: TrainingConfig, hardware: HardwareConfig,
                           optimizer: OptimizerConfig, stage: int = 0) -> int:
    """Bytes one micro-batch's forward and loss leave allocated for its backward on `stage`: saved
    activations, the saved log-probabilities and, with torch.amp, the 16-bit weight copies autograd
    saved, and under FSDP the unsharded parameters kept for backward (ZeRO-2: all; ZeRO-3: the
    root's). The measurable counterpart: (in use after forward + loss) - (in use before)."""
    run, common, st = _rank(model, layout, training, hardware, optimizer, stage)
    lay, act, mb = st.lay, st.prec.act, common.micro_batch
    none_blocks = lay.blocks - lay.policy_blocks
    total = none_blocks * mb.none + lay.policy_blocks * mb.policy + mb.positions
    chunked = run.layout.chunked_loss
    if lay.last:
        total += mb.final + mb.loss.saved
        total += mb.loss.output if mb.loss.keeps_output else 0
    if act.autocast:  # the chunked loss's output-weight cast is recomputed in backward, not saved
        total += st.prec.compute * (none_blocks * (lay.block_matmul - lay.block_float8)
                                     + (0 if chunked else lay.output_matmul))
    if st.fsdp:  # unsharded parameters gathered in the forward and kept for backward
        zero = run.layout.zero_stage
        kept = st.params if zero == 2 else lay.embedding + lay.head if zero == 3 else 0
        total += st.prec.compute * kept
        if zero == 2 and run.layout.fp8_gathers:  # the float8 weights gathered in fp8
            total -= (st.prec.compute - 1) * lay.blocks * lay.block_float8
    return total


def zero_model_state_bytes(num_params: int, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                           optimizer_bytes: int = 12) -> int:
    """Model-state bytes per rank as the ZeRO paper counts them (Rajbhandari et al., arXiv
    1910.02054, Sec. 3.1 and 5): fp16 parameters (2 bytes) and gradients (2 bytes) plus K = 12
    bytes of Adam state (fp32 master copy, momentum, variance) per parameter; stage 1 shards the K
    bytes over the dp ranks, stage 2 also the gradients, stage 3 also the parameters.

    The paper's closed forms, against which estimate_memory's engines compare (*-mixed AdamW;
    parallel/data_parallel.py's table): stage 0 (DDP) holds the same 16 bytes, split 4 + 4 + 8
    (fp32 parameters and gradients; autocast's 16-bit copies on top); stage 1 (parallel/zero.py) is
    this form exactly, 2Ψ + 2Ψ + 12Ψ/N (6Ψ + 12Ψ/N with optimizer.grad_accum_dtype='fp32'); stage 2
    (FSDP2, reshard_after_forward=False) is 2Ψ + 16Ψ/N, its gradient shards fp32 (4Ψ/N, not 2Ψ/N);
    stage 3 (FSDP2) is 16Ψ/N."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: choose 0, 1, 2 or 3")
    per_param = (param_bytes / (dp if stage >= 3 else 1) + grad_bytes / (dp if stage >= 2 else 1)
                 + optimizer_bytes / (dp if stage >= 1 else 1))
    return round(num_params * per_param)
