"""Collective cost models, the link each mesh axis uses, and the collectives one training step issues.

Torch-free: pure functions of numbers and the config.

Cost models (bandwidth-optimal ring algorithms, Thakur et al. 2005; NCCL's own tuning model has the
same shape): for a group of n ranks, a message of B bytes and a link of bandwidth bw per direction
with per-step latency a, plus a fixed launch cost a0 per collective,

| collective     | B is                              | time                                          |
|----------------|-----------------------------------|-----------------------------------------------|
| all-reduce     | the buffer                        | min(ring: a0 + 2(n-1) a + 2(n-1)/n B/bw,      |
|                |                                   |     tree: a0 + 2 log2(n) a + 2 B/bw)          |
| all-gather     | the gathered output (all shards)  | a0 + (n-1) a + (n-1)/n B/bw                   |
| reduce-scatter | the input (before scattering)     | a0 + (n-1) a + (n-1)/n B/bw                   |
| all-to-all     | what one rank holds (sends 1-1/n) | a0 + (n-1) a + (n-1)/n B/bw                   |
| point-to-point | the message                       | a0 + a + B/bw                                 |

These are NCCL's Simple protocol. A ring collective on a GPU link may instead run NCCL's LL or
LL128 (hardware.PROTOCOLS: a smaller fixed cost and per-step latency, a share of the bandwidth);
NCCL's tuner times each enabled protocol and runs the fastest, and so does the ring here, which
makes small, latency-bound collectives (a norm gain's gradient, the loss statistics) cheaper.

Links: the world is the mesh pp x dp_replicate x dp_shard x cp x tp, outermost first (see
trainfit.parallel.layout), ranks numbered with tp fastest and filled node by node. An axis of size n
and stride s (the product of the sizes inside it) keeps every group inside one node when the whole
job fits in a node or when s x n divides hardware.gpus_per_node; such an axis uses the intra-node
link, any other the inter-node one. A group spanning several axes is intra-node only if each of
them is: a ring is as slow as its slowest hop.

A group that leaves the node gets, of the node's NICs, the share of its own members there
(`members_per_node`): NCCL runs a collective over several channels, each a ring (or tree) whose
node-to-node hop goes through a different NIC, so a group with g members on each node of G GPUs
drives g / G of the node's NICs, g times one GPU's share (hardware.inter_node_link), at most what
each member's own intra-node link carries. A data-parallel group with one rank per node keeps one
GPU's share; a tensor-parallel group of 16 over two 8-GPU nodes drives all 8 NICs of each. nccl-tests
shows the proportionality: all-reduce bus bandwidth over 4 nodes is about twice as high with 8 GPUs
per node as with 4 on the same NICs (NVIDIA/nccl#1168: ~90 against ~45 GB/s at 256 MB).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from trainfit.config import ModelConfig, TrainingConfig
from trainfit.hardware import COLLECTIVE_BASE_LATENCY_S, Link
from trainfit.models.architecture import config_key, describe, layer_kinds
from trainfit.models.block_spec import block_linears
from trainfit.models.params import param_counts
from trainfit.models.routing import expert_capacity
from trainfit.parallel.collectives import SHARD, CollectiveCall, collective_calls, group_size, kind_parts, rank_calls
from trainfit.parallel.engine import DDP_BUCKET_BYTES, ZERO1_BUCKET_BYTES
from trainfit.parallel.layout import AXES, Layout
from trainfit.perf.fp8_casts import FP8_BYTES, float8_linears

KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p")

COUNT_BYTES = 8
"""Dropless expert parallelism exchanges its per-expert row counts as int64 first."""
FP32_BYTES, LOW_BYTES = 4, 2
"""Gradients are reduced in fp32 under the *-mixed modes by FSDP2 (MixedPrecisionPolicy(reduce_dtype=
float32), as torchtitan configures it) and DDP (the fp32 gradients of fp32 parameters); ZeRO-1
reduces in its parameters' dtype (16-bit) unless optimizer.grad_accum_dtype='fp32'."""


# ---------------------------------------------------------------- cost models


def ring_time(steps: int, nbytes: float, link: Link, reduce: bool = False) -> float:
    """A ring collective of `steps` steps moving `nbytes` per rank over the link, in NCCL's fastest
    protocol: Simple at the link's own figures, or one of link.protocols (`reduce`: an all-reduce,
    whose LL bandwidth share is the lower one)."""
    simple = COLLECTIVE_BASE_LATENCY_S + steps * link.latency_s + nbytes / link.bytes_per_s
    return min([simple, *(p.base_s + steps * p.hop_s
                          + nbytes / (link.bytes_per_s * (p.bandwidth_share_reduce if reduce else p.bandwidth_share))
                          for p in link.protocols)])


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring or (NCCL double binary) tree all-reduce of an nbytes buffer, whichever is faster."""
    if n <= 1:
        return 0.0
    ring = ring_time(2 * (n - 1), 2 * (n - 1) / n * nbytes, link, reduce=True)
    tree = COLLECTIVE_BASE_LATENCY_S + 2 * math.log2(n) * link.latency_s + 2 * nbytes / link.bytes_per_s
    return min(ring, tree)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather whose gathered output is nbytes (each rank contributes nbytes / n)."""
    if n <= 1:
        return 0.0
    return ring_time(n - 1, (n - 1) / n * nbytes, link)


def reduce_scatter_time(nbytes: float, n: int, link: Link) -> float:
    """Ring reduce-scatter of an nbytes input (each rank keeps nbytes / n of the sum)."""
    return all_gather_time(nbytes, n, link)


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Pairwise all-to-all: each rank holds nbytes and sends (n-1)/n of it, one peer per step."""
    return all_gather_time(nbytes, n, link)


def p2p_time(nbytes: float, link: Link) -> float:
    """One send/recv between two ranks."""
    return COLLECTIVE_BASE_LATENCY_S + link.latency_s + nbytes / link.bytes_per_s


_GROUP_TIMES = {"all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time, "all_reduce": all_reduce_time,
                "all_to_all": all_to_all_time}


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Time of one collective of a kind in KINDS (nbytes as each cost function defines it)."""
    if kind == "p2p":
        return p2p_time(nbytes, link)
    return _GROUP_TIMES[kind](nbytes, n, link)


# ---------------------------------------------------------------- which link


def axis_stride(layout: Layout, axis: str) -> int:
    """Rank distance between neighbours along an axis: the product of the sizes of the axes inside it."""
    sizes = layout.axis_sizes()
    return math.prod(sizes[a] for a in AXES[AXES.index(axis) + 1:])


def span_is_intra_node(size: int, stride: int, num_gpus: int, gpus_per_node: int) -> bool:
    """Whether every group of `size` ranks spaced `stride` apart lies inside one node."""
    return size <= 1 or num_gpus <= gpus_per_node or gpus_per_node % (size * stride) == 0


def axes_are_intra_node(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    stride = 1
    for axis in reversed(AXES):  # innermost first: each axis's stride is the product of the sizes inside it
        size = getattr(layout, axis)
        if axis in axes and not span_is_intra_node(size, stride, layout.world_size, gpus_per_node):
            return False
        stride *= size
    return True


def members_per_node(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> int:
    """Ranks of one group over these mesh axes that share a node (rank 0's group; every group is alike
    where the axes' sizes divide the node): the group's rank offsets below gpus_per_node. Expert
    groups as group_is_intra_node lays them out."""
    if axes == ("ep",):
        spans = ((layout.ep, layout.tp),)
    elif axes == ("edp",):
        spans = ((layout.dp_shard * layout.cp // layout.ep, layout.tp * layout.ep),)
    else:
        spans = tuple((getattr(layout, a), axis_stride(layout, a)) for a in AXES if a in axes)
    return _offsets_below(tuple(sorted(spans, key=lambda span: span[1])), gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _offsets_below(spans: tuple[tuple[int, int], ...], limit: int) -> int:
    """How many sums of i x stride (0 <= i < size, one term per (size, stride), innermost first) are below `limit`."""
    offsets = [0]
    for size, stride in spans:
        offsets = [o + i * stride for o in offsets for i in range(size) if o + i * stride < limit]
    return max(1, len(offsets))


def group_is_intra_node(layout: Layout, axes: tuple[str, ...], gpus_per_node: int) -> bool:
    """Whether a group over these mesh axes stays inside a node (its slowest hop sets its link).
    Expert-parallel groups ("ep"): ep consecutive ranks of the dp_shard x cp block (stride tp); the
    ranks holding the same experts ("edp"): that block's ranks ep x tp apart."""
    if axes == ("ep",):
        return span_is_intra_node(layout.ep, layout.tp, layout.world_size, gpus_per_node)
    if axes == ("edp",):
        return span_is_intra_node(layout.dp_shard * layout.cp // layout.ep, layout.tp * layout.ep, layout.world_size,
                                  gpus_per_node)
    return axes_are_intra_node(layout, axes, gpus_per_node)


# ---------------------------------------------------------------- what a step issues


class Collective(NamedTuple):
    """One kind of collective call a rank makes, `count` times per optimizer step."""

    kind: str
    """all_gather | reduce_scatter | all_reduce | all_to_all | p2p."""
    purpose: str
    """fsdp_param (ZeRO/FSDP parameter all-gather), grad_sync (the data-parallel gradient reduction,
    once per step), tp, cp, ep, pp."""
    axes: tuple[str, ...]
    """Mesh axes of the group ("ep" for expert groups)."""
    group_size: int
    nbytes: int
    """Bytes per call, as the cost functions define them."""
    count: int
    """Calls per step on one rank."""
    phase: str
    """forward | backward (recomputation counts as backward) | step (ZeRO-1's, around the optimizer
    step, after the last backward)."""
    unit: str = ""
    """Data parallel only: "root" (the FSDP unit of embeddings/norm/output: gathered first, reduced
    last), "blocks" (one FSDP unit per block), "experts" (a block's routed experts under expert
    parallelism, in the block's unit on their own mesh), "buckets" (DDP)."""
    per_microbatch: bool = False
    """The calls repeat in every micro-batch (count includes the micro-batches), else once per step."""
    overlaps: tuple[str, ...] = ()
    """Under parallel.async_tp, the GEMMs the call hides behind (parallel/collectives.CollectiveCall); a
    re-gather's (tensor "regathered"), the GEMMs whose input gradients it may run beside, whatever async_tp
    says (perf/engines.Engine.regather_overlaps_dgrad decides)."""
    tensor: str = ""
    """What moves: a key of parallel/collectives.TENSORS."""


def expert_rows(model: ModelConfig, num_tokens: int) -> int:
    """Rows one rank sends per expert-parallel all-to-all (parallel/expert.py) for a micro-batch of
    num_tokens: dropless, one per (token, choice) pair (what it receives varies with the routing,
    that on average); capacity, every expert's whole slot buffer, used or not."""
    if model.capacity_factor:
        return model.num_experts * expert_capacity(num_tokens, model.experts_per_token, model.num_experts,
                                                   model.capacity_factor)
    return num_tokens * model.experts_per_token


def precision_bytes(mode: str) -> tuple[int, int, int]:
    """(gathered parameter, reduced gradient, activation) bytes per element of a precision mode."""
    if mode == "fp32":
        return FP32_BYTES, FP32_BYTES, FP32_BYTES
    return LOW_BYTES, LOW_BYTES if mode == "bf16-pure" else FP32_BYTES, LOW_BYTES


def stage_params(model: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(one block's, the root unit's) parameters on one rank of the busiest stage, before ZeRO sharding.

    Blocks: each linear as tensor and expert parallelism split it (models/block_spec.py: an MoE
    feed-forward whole on the tp ranks, its routed experts / ep), norms whole. Root (embeddings,
    final norm, output; the vocabulary's rows split over tp): all of it without pipeline parallelism,
    else the larger of the first and last stage's part.
    Once per model and degrees (the planner asks for every layout's, several times).
    """
    return _stage_params(config_key(model), layout.tp, layout.ep, layout.pp > 1)


@functools.lru_cache(maxsize=1024)
def _stage_params(model_key: tuple, tp: int, ep: int, pipelined: bool) -> tuple[int, int]:
    model = ModelConfig(*model_key)
    c, arch = param_counts(model), describe(model)
    block = sum(linear.local_params(tp, ep) for linear in block_linears(model)) + c.norms
    # the vocabulary's rows split over tp; the final norm and GPT-2's positions whole on every tp rank
    vocab = arch.vocab_size * arch.dim // tp
    first = vocab + c.embedding - arch.vocab_size * arch.dim
    last = c.final_norm + (c.output // tp)
    return block, first + last if not pipelined else max(first, last)


def expert_params(model: ModelConfig, layout: Layout) -> int:
    """One block's routed-expert parameters on one rank (its num_experts / ep experts, split by tp)."""
    return sum(linear.local_params(layout.tp, layout.ep) for linear in block_linears(model) if linear.routed)


def collectives_key(layout: Layout) -> tuple[str, int, str, bool]:
    """What step_collectives reads of a layout's memory knobs (memory.*, parallel.sp_recompute_gather): the
    checkpointing, offload only through data_parallel, the re-gathers. The planner times a group's
    collectives once per key."""
    return layout.activation_checkpointing, layout.ac_every_n_layers, layout.data_parallel, layout.regathers


_PURPOSES = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp"}


def _purpose(call: CollectiveCall) -> str:
    """Collective.purpose of a declared call: the model-parallel technique, or data parallelism's
    parameter gathers (fsdp_param, zero1_params) and gradient reduction (grad_sync)."""
    if call.technique in _PURPOSES:
        return _PURPOSES[call.technique]
    if call.tensor.endswith("_params") or call.tensor == "block_params_fp8":
        return "zero1_params" if call.technique == "zero1" else "fsdp_param"
    return "grad_sync"


def tensor_bytes(model: ModelConfig, layout: Layout, training: TrainingConfig) -> dict[str, float]:
    """Bytes of one call moving each of parallel/collectives.TENSORS on one rank of the busiest stage
    (as the cost functions define them), and "buckets": the gradient buckets of DDP or ZeRO-1."""
    m, t = model, training
    param_b, grad_b, act_b = precision_bytes(layout.precision)
    layers = layout.busiest_rank_blocks()
    block, root = stage_params(model, layout)
    shards = group_size(layout, SHARD)
    seqs = layout.global_batch_size / (layout.dp * layout.num_microbatches)  # sequences per micro-batch on a rank
    act = int(seqs * t.seq_len / layout.cp * m.dim * act_b)  # one micro-batch's hidden states, full width
    tokens = seqs * t.seq_len / layout.cp
    out: dict[str, float] = {}
    if layout.zero_stage == 0:
        total = (layers * block + root) * grad_b
        buckets = max(1, -(-total // DDP_BUCKET_BYTES))
        out.update(buckets=buckets, bucket_grads=total / buckets)
    elif layout.zero_stage == 1:
        elements = layers * block + root
        grad_b = FP32_BYTES if layout.grad_accum_dtype == "fp32" else param_b
        buckets = max(1, -(-elements * max(grad_b, param_b) // ZERO1_BUCKET_BYTES))
        per_bucket = elements / buckets
        out.update(buckets=buckets, bucket_grads=per_bucket * grad_b, bucket_grad_shard=per_bucket * grad_b / shards,
                   bucket_params=per_bucket * param_b)
    else:
        experts = expert_params(model, layout) if layout.ep > 1 else 0
        block -= experts  # under expert parallelism the routed experts are a unit part of their own
        fp8_weights = sum(k * n for k, n, _ in float8_linears(model).values()) // layout.tp
        out.update(root_params=root * param_b, block_params=block * param_b,
                   block_params_fp8=(block - fp8_weights) * param_b + fp8_weights * FP8_BYTES,
                   expert_params=experts * param_b, root_grads=root * grad_b, block_grads=block * grad_b,
                   expert_grads=experts * grad_b, root_grad_shard=root * grad_b / shards,
                   block_grad_shard=block * grad_b / shards)
    stream_b = layout.stream_bytes
    out.update(row_output=act, stream=act / act_b * stream_b, loss_stats=tokens * FP32_BYTES,
               positions=t.seq_len / layout.cp * m.dim * stream_b, norm_gain=m.dim * param_b,
               qk_norm_gain=describe(m).attention.head_dim * param_b,
               kv=int(seqs * t.seq_len * describe(m).attention.kv_dim / layout.tp * act_b),
               boundary=act / layout.tp if layout.sequence_parallel else act, regathered=act)
    if m.num_experts:
        out.update(routed_tokens=expert_rows(m, int(tokens)) * m.dim * act_b,
                   expert_counts=m.num_experts * COUNT_BYTES)
    return out


def step_collectives(model: ModelConfig, layout: Layout, training: TrainingConfig) -> list[Collective]:
    """Every collective one rank of the busiest pipeline stage issues in one optimizer step: the timed
    calls parallel/collectives.py declares for the layout (what each technique issues, and why), each of
    tensor_bytes' size, repeated over the micro-batches where accumulation repeats it. Calls that
    differ only in their site (a dense block's wo and w2 outputs, K and V) are one Collective, except
    under parallel.async_tp where they overlap different GEMMs.

    Bytes: gradients reduced in fp32 under the *-mixed modes (FP32_BYTES); tensor parallelism's
    hidden states in the activation dtype, except under autocast (a *-mixed mode without FSDP2/ZeRO-1:
    fp32 parameters), where the residual stream, the norms' and embedding's outputs and the gradients
    into them stay fp32 (Layout.stream_bytes) and only the row-parallel outputs and their gradients
    are 16-bit; expert parallelism's rows as expert_rows says.
    """
    merged: dict[tuple, int] = {}
    if len(layer_kinds(model)) == 1:
        _price(model, layout, training, collective_calls(model, layout), merged, 1)
    else:  # each kind's blocks with their own sizes (parallel/collectives.kind_parts)
        for kind, blocks, wrapped, sign in kind_parts(model, layout):
            _price(kind, layout, training, rank_calls(kind, layout, blocks, wrapped), merged, sign)
    return [Collective(*key[:5], count, *key[5:]) for key, count in merged.items() if count > 0]


def _price(model: ModelConfig, layout: Layout, training: TrainingConfig, calls: tuple[CollectiveCall, ...],
           merged: dict[tuple, int], sign: int) -> None:
    """Add `calls` of `model` (its layers alike), each of tensor_bytes' size, to `merged`'s counts (times
    `sign`)."""
    sizes = tensor_bytes(model, layout, training)
    n_mb = layout.num_microbatches
    ranks = {axes: group_size(layout, axes) for axes in {c.axes for c in calls}}  # a few distinct axes
    for call in calls:
        if not call.timed:
            continue
        nbytes = sizes[call.tensor]
        count = call.count * (n_mb if call.per_microbatch else 1) * (sizes["buckets"] if call.per_bucket else 1)
        if nbytes > 0:
            key = (call.kind, _purpose(call), call.axes, ranks[call.axes], int(nbytes), call.phase,
                   call.unit, call.per_microbatch,
                   call.overlaps if layout.async_tp or call.tensor == "regathered" else (), call.tensor)
            merged[key] = merged.get(key, 0) + sign * int(count)
