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

Links: the world is the mesh pp x dp_replicate x dp_shard x cp x tp, outermost first (see
trainfit.parallel.layout), ranks numbered with tp fastest and filled node by node. An axis of size n
and stride s (the product of the sizes inside it) keeps every group inside one node when the whole
job fits in a node or when s x n divides hardware.gpus_per_node; such an axis uses the intra-node
link, any other the inter-node one. A group spanning several axes is intra-node only if each of
them is: a ring is as slow as its slowest hop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from trainfit.config import ModelConfig, TrainingConfig
from trainfit.hardware import COLLECTIVE_BASE_LATENCY_S, Link
from trainfit.models.block_spec import block_linears
from trainfit.models.params import param_counts
from trainfit.models.routing import expert_capacity
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


def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring or (NCCL double binary) tree all-reduce of an nbytes buffer, whichever is faster."""
    if n <= 1:
        return 0.0
    ring = COLLECTIVE_BASE_LATENCY_S + 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bytes_per_s
    tree = COLLECTIVE_BASE_LATENCY_S + 2 * math.log2(n) * link.latency_s + 2 * nbytes / link.bytes_per_s
    return min(ring, tree)


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather whose gathered output is nbytes (each rank contributes nbytes / n)."""
    if n <= 1:
        return 0.0
    return COLLECTIVE_BASE_LATENCY_S + (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bytes_per_s


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
    final norm, output): all of it without pipeline parallelism, else the larger of the first and
    last stage's part.
    """
    c = param_counts(model)
    block = sum(linear.local_params(layout.tp, layout.ep) for linear in block_linears(model)) + c.norms
    root = c.embedding + c.final_norm + c.output if layout.pp == 1 else max(c.embedding, c.final_norm + c.output)
    return block, root // layout.tp


def expert_params(model: ModelConfig, layout: Layout) -> int:
    """One block's routed-expert parameters on one rank (its num_experts / ep experts, split by tp)."""
    return sum(linear.local_params(layout.tp, layout.ep) for linear in block_linears(model) if linear.routed)


def _tp_recompute_calls(sequence_parallel: bool, policy: str) -> tuple[int, int, int]:
    """(all-gather, reduce-scatter, all-reduce) calls one wrapped block's recomputation repeats.

    Forward per dense block: [AR, AR] without sequence parallelism, [AG, RS, AG, RS] with it (MoE:
    [AR], [AG, RS, AG]). Full recomputation reruns them all but a dense block's last (nothing saves
    its output); selective saves the reductions' outputs (models/checkpoint_policy.py: reduce-scatter
    and all-reduce) and reruns the all-gathers.
    """
    if policy == "none":
        return 0, 0, 0
    if not sequence_parallel:
        return (0, 0, 1) if policy == "full" else (0, 0, 0)
    return (2, 1, 0) if policy == "full" else (2, 0, 0)


def _tp_calls(model: ModelConfig, layout: Layout, layers: int, wrapped: int) -> dict[tuple[str, str, str], int]:
    """Tensor-parallel calls per micro-batch, keyed (kind, phase, what moves): "out" a row-parallel
    output (or its gradient), "stream" the residual stream (a norm's or the embedding's output, or the
    gradient into one), "loss" loss_parallel's per-token statistics, "pos" GPT-2's learned positions,
    "gain" a sequence-parallel norm parameter's gradient (step_collectives says which plan issues which).
    """
    outs = 1 if model.num_experts else 2  # row-parallel outputs per block (MoE: attention's wo only)
    output = 1  # the busiest stage is the last: the output projection and the loss ...
    embedding = int(layout.pp == 1)  # ... and the embedding when there is one stage
    ag, rs, ar = _tp_recompute_calls(layout.sequence_parallel, layout.activation_checkpointing)
    loss = {("all_reduce", "forward", "loss"): 3 * output}
    if not layout.sequence_parallel:
        return {**loss,
                ("all_reduce", "forward", "out"): outs * layers,
                ("all_reduce", "forward", "stream"): embedding,
                ("all_reduce", "backward", "stream"): outs * layers + output,
                ("all_reduce", "backward", "out"): ar * wrapped}
    c = param_counts(model)  # one all-reduce per gain (and bias) tensor of dim elements, under FSDP2 only
    gains = (c.norms * layers + c.final_norm * output) // model.dim if layout.data_parallel == "fsdp" else 0
    return {**loss,
            ("all_gather", "forward", "stream"): 2 * layers + output,
            ("reduce_scatter", "forward", "out"): outs * layers,
            ("reduce_scatter", "forward", "stream"): embedding,
            ("all_gather", "backward", "out"): outs * layers,
            ("all_gather", "backward", "stream"): (2 - outs) * layers + embedding + ag * wrapped,
            ("reduce_scatter", "backward", "stream"): outs * layers + output,
            ("reduce_scatter", "backward", "out"): rs * wrapped,
            ("all_gather", "backward", "pos"): embedding * (model.family == "gpt2"),
            ("all_reduce", "backward", "gain"): gains}


def collectives_key(layout: Layout) -> tuple[str, int, str]:
    """What step_collectives reads of a layout's memory knobs (memory.*): the checkpointing, and
    offload only through data_parallel. The planner times a group's collectives once per key."""
    return layout.activation_checkpointing, layout.ac_every_n_layers, layout.data_parallel


def step_collectives(model: ModelConfig, layout: Layout, training: TrainingConfig) -> list[Collective]:
    """Every collective one rank of the busiest pipeline stage issues in one optimizer step.

    Data parallel, as trainfit.parallel.data_parallel builds it:
    - zero_stage 0 (DDP): one all-reduce of all gradients per step (accumulation skips it for
      every micro-batch but the last) over dp_replicate x dp_shard x cp, in DDP buckets.
    - zero_stage 1 (parallel/zero.py), once per step after the last backward, bucket by bucket:
      a reduce-scatter of the accumulated gradients over dp_shard (in the parameters' dtype, or
      fp32 with optimizer.grad_accum_dtype='fp32'), under HSDP (or cp > 1) an all-reduce of the
      shard over dp_replicate x cp, and after the optimizer step an all-gather of the updated
      parameters over dp_shard (in the parameters' dtype): the volume of DDP's all-reduce, split
      around the step.
    - zero_stage 2/3 (FSDP2 units: each block, plus the root holding embeddings/norm/output):
      every micro-batch reduce-scatters each unit's gradients over dp_shard (FSDP keeps shards
      only); once per step (HSDP, or cp > 1) an all-reduce of the shards over dp_replicate x cp.
      Parameter all-gathers over dp_shard, every micro-batch: each unit in forward, and under
      ZeRO-3 each block again in backward (the root is never resharded after forward; ZeRO-2 is
      reshard_after_forward=False, so no block is either). Under expert parallelism a block's routed
      experts (this rank's num_experts / ep) are gathered and reduce-scattered apart, over edp
      (dp_shard x cp / ep ranks: parallel/mesh.expert_mesh), none of it when edp is 1.
    Tensor parallel (parallel/tensor_parallel.py's DTensor plans), per micro-batch on the tp group:
    - each row-parallel output (a dense block's wo and w2; an MoE block's wo: its feed-forward is
      replicated) all-reduced forward, and the input gradient of each column-parallel group (attention,
      MLP) backward; the vocabulary-parallel embedding's partial output all-reduced forward, the output
      projection's input gradient backward;
    - with sequence parallelism, all-gathers of the attention, MLP (MoE) and output inputs, and
      reduce-scatters of the row-parallel and embedding outputs, forward; backward, the dual of each
      (a reduce-scatter for an all-gather and vice versa; an MoE's output, sliced forward, is
      all-gathered; GPT-2's positions, sliced forward, too). Under FSDP2 the norms' replicated gains'
      partial gradients are all-reduced in each micro-batch's backward, one call per parameter;
    - loss_parallel's cross-entropy: 3 all-reduces of one fp32 number per token (max, sum of exps,
      target logit) forward;
    - recomputation repeats what _tp_recompute_calls says;
    - bytes: the hidden states (the whole sequence) in the activation dtype, except under autocast
      (a *-mixed mode without FSDP2/ZeRO-1: fp32 parameters), where the residual stream, the norms'
      and embedding's outputs and the gradients into them stay fp32 and only the row-parallel outputs
      and their gradients are 16-bit.
    Context parallel (parallel/context_parallel.py), per attention layer and micro-batch on the cp
    group: K and V of the whole sequence all-gathered forward, two calls, and their gradients
    reduce-scattered backward, two calls; no all-gather in backward except recomputation's, which
    repeats both under every checkpointing policy (selective too: all-gathers are not saved).
    Expert parallel (parallel/expert.py), per MoE layer and micro-batch on the ep group: the dispatch
    and combine all-to-alls forward and their reverses backward (rerun under full recomputation; the
    selective policies keep them), each sending expert_rows hidden states; dropless also exchanges
    the per-expert counts first (forward, and in full recomputation). A dropless rank sends exactly
    its pairs in the dispatch and the combine's reverse; the combine and the dispatch's reverse
    send what it received, the routing's, on average the same.
    Pipeline parallel: one activation send forward and one gradient send backward per micro-batch
    and virtual stage.
    Not modelled: the gradient-norm all-reduces (one per layout group of DTensor gradients) and the
    loss all-reduce for logging, both after the last backward; without data parallelism, the sequence-
    parallel gains' partial gradients, which DTensor all-reduces at each use (clipping, the optimizer)
    after the backward; sharding padding.
    """
    m, t = model, training
    param_b, grad_b, act_b = precision_bytes(layout.precision)
    n_mb = layout.num_microbatches
    # The rank with the most blocks, and how many of them are checkpointed (global indices: a stage
    # that starts at an odd block wraps other ones than its count alone says).
    layers, wrapped = max((blocks, wrapped) for blocks, wrapped, _ in layout.rank_shapes())
    block, root = stage_params(model, layout)
    policy = layout.activation_checkpointing
    wrapped = 0 if policy == "none" else wrapped
    seqs = layout.global_batch_size / (layout.dp * n_mb)  # sequences per micro-batch on a rank
    act = int(seqs * t.seq_len / layout.cp * m.dim * act_b)  # one micro-batch's hidden states, full width
    calls = n_mb * layers
    out: list[Collective] = []

    def add(kind: str, purpose: str, axes: tuple[str, ...], size: int, nbytes: float, count: int, phase: str,
            unit: str = "", per_microbatch: bool = True) -> None:
        if size > 1 and count > 0 and nbytes > 0:
            out.append(Collective(kind, purpose, axes, size, int(nbytes), count, phase, unit, per_microbatch))

    # Data parallel.
    shard = ("dp_shard",)
    rest, replicas = ("dp_replicate", "cp"), layout.dp_replicate * layout.cp
    if layout.zero_stage == 0:
        total = (layers * block + root) * grad_b
        buckets = max(1, -(-total // DDP_BUCKET_BYTES))
        add("all_reduce", "grad_sync", ("dp_replicate", "dp_shard", "cp"), layout.dp * layout.cp, total / buckets,
            buckets, "backward", "buckets", per_microbatch=False)
    elif layout.zero_stage == 1:
        elements = layers * block + root
        grad_b = FP32_BYTES if layout.grad_accum_dtype == "fp32" else param_b
        buckets = max(1, -(-elements * max(grad_b, param_b) // ZERO1_BUCKET_BYTES))
        per_bucket = elements / buckets
        add("reduce_scatter", "grad_sync", shard, layout.dp_shard, per_bucket * grad_b, buckets, "step", "buckets",
            per_microbatch=False)
        add("all_reduce", "grad_sync", rest, replicas, per_bucket * grad_b / layout.dp_shard, buckets, "step",
            "buckets", per_microbatch=False)
        add("all_gather", "zero1_params", shard, layout.dp_shard, per_bucket * param_b, buckets, "step",
            "buckets", per_microbatch=False)
    else:
        # Expert parallelism: a block's routed experts are sharded within its unit on their own mesh,
        # edp (data_parallel.ExpertShards): a second all-gather and reduce-scatter per block, over edp.
        experts = expert_params(model, layout) if layout.ep > 1 else 0
        block -= experts
        gathered = block * param_b
        if layout.fp8_gathers:  # the float8 linears' weights travel in fp8 (precision.fp8_all_gather), the rest as is
            fp8_weights = sum(k * n for k, n, _ in float8_linears(model).values()) // layout.tp
            gathered = (block - fp8_weights) * param_b + fp8_weights * FP8_BYTES
        edp = layout.dp_shard * layout.cp // layout.ep
        add("all_gather", "fsdp_param", shard, layout.dp_shard, root * param_b, n_mb, "forward", "root")
        for what, axes, size, nbytes in (("blocks", shard, layout.dp_shard, gathered),
                                          ("experts", ("edp",), edp, experts * param_b)):
            add("all_gather", "fsdp_param", axes, size, nbytes, n_mb * layers, "forward", what)
            if layout.zero_stage == 3:
                add("all_gather", "fsdp_param", axes, size, nbytes, n_mb * layers, "backward", what)
        add("reduce_scatter", "grad_sync", ("edp",), edp, experts * grad_b, n_mb * layers, "backward", "experts")
        add("reduce_scatter", "grad_sync", shard, layout.dp_shard, block * grad_b, n_mb * layers, "backward", "blocks")
        add("reduce_scatter", "grad_sync", shard, layout.dp_shard, root * grad_b, n_mb, "backward", "root")
        add("all_reduce", "grad_sync", rest, replicas, block * grad_b / layout.dp_shard, layers, "backward", "blocks",
            per_microbatch=False)
        add("all_reduce", "grad_sync", rest, replicas, root * grad_b / layout.dp_shard, 1, "backward", "root",
            per_microbatch=False)

    # Tensor parallel.
    stream_b = layout.stream_bytes
    tokens = seqs * t.seq_len / layout.cp
    moved = {"out": act, "stream": act / act_b * stream_b, "loss": tokens * FP32_BYTES,
             "pos": t.seq_len / layout.cp * m.dim * stream_b, "gain": m.dim * param_b}
    for (kind, phase, what), count in _tp_calls(m, layout, layers, wrapped).items():
        add(kind, "tp", ("tp",), layout.tp, moved[what], count * n_mb, phase)

    # Context parallel: K, then V, of the whole sequence (their heads are split by tp).
    kv = int(seqs * t.seq_len * m.num_kv_heads * (m.dim // m.num_heads) / layout.tp * act_b)
    add("all_gather", "cp", ("cp",), layout.cp, kv, 2 * calls, "forward")
    add("all_gather", "cp", ("cp",), layout.cp, kv, 2 * wrapped * n_mb, "backward")
    add("reduce_scatter", "cp", ("cp",), layout.cp, kv, 2 * calls, "backward")

    # Expert parallel: each (token, choice) pair's hidden state goes to its expert's rank and back.
    if m.num_experts:
        routed = expert_rows(m, int(tokens)) * m.dim * act_b
        recomputed = wrapped if policy == "full" else 0
        add("all_to_all", "ep", ("ep",), layout.ep, routed, 2 * calls, "forward")
        add("all_to_all", "ep", ("ep",), layout.ep, routed, 2 * (layers + recomputed) * n_mb, "backward")
        if not m.capacity_factor:  # the per-expert counts, exchanged first
            add("all_to_all", "ep", ("ep",), layout.ep, m.num_experts * COUNT_BYTES, calls, "forward")
            add("all_to_all", "ep", ("ep",), layout.ep, m.num_experts * COUNT_BYTES, recomputed * n_mb, "backward")

    # Pipeline parallel: a stage boundary per micro-batch and virtual stage, each way.
    boundary = act / layout.tp if layout.sequence_parallel else act
    add("p2p", "pp", ("pp",), layout.pp, boundary, n_mb * layout.pp_virtual_stages, "forward")
    add("p2p", "pp", ("pp",), layout.pp, boundary, n_mb * layout.pp_virtual_stages, "backward")
    return out

