"""What one rank of a pipeline stage holds, in element counts after tensor and expert parallelism
(`RankLayout`): its blocks, which of them the checkpointing policy wraps, its ends (embedding, head), the
micro-batches in flight; and what every rank of a layout shares (`LayoutCommon`: dtypes, a block's parameters,
a micro-batch's sizes), computed once per estimate. The inputs of every per-rank term. Torch-free."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.hardware import device_type
from trainfit.memory.closed_form.block.activation_terms import ActDtypes
from trainfit.memory.closed_form.block.adapter_activations import first_block_terms, first_block_unsaved_casts
from trainfit.memory.closed_form.comm_buffers import comm_buffer_bytes
from trainfit.memory.closed_form.micro_batch import MicroBatch, SharedSizes
from trainfit.memory.closed_form.run_shape import (
    MicroBatchShape,
    Precision,
    Run,
    assumed_attention_kernel,
    precision_of,
    rope_table_bytes,
)
from trainfit.models.architecture import config_key, describe, document_mask_kernel, eager_attention, kind_of_layers
from trainfit.models.block_spec import block_linears
from trainfit.models.params import ParamCounts, param_counts
from trainfit.parallel.layout import Layout
from trainfit.parallel.stage_split import RankPlacement, checkpointed
from trainfit.peft.spec import Adaptation, adapter_magnitudes, adapter_params, nf4_bytes, routed_adapter_params
from trainfit.perf.fp8_casts import float8_linears


class BlockParams(NamedTuple):
    """A block's parameters on a rank (elements after tp and ep), and what sizes a rank's ends: the
    same on every pipeline rank of a layout (RankLayout's block_* fields)."""

    params: int
    matmul: int
    float8: int
    experts: int
    routed_adapters: int
    """PEFT: the adapters of the routed experts on the rank, part of experts and of adapters."""
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
    adapters: int = 0
    """PEFT's adapter parameters of a block (peft/spec.py), part of params and matmul."""
    nf4: int = 0
    """QLoRA: weights of the block held in NF4, part of matmul."""
    nf4_bytes: int = 0
    """Their bytes in NF4."""


class RankLayout(NamedTuple):
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
    """A block's routed-expert weights on the rank (its 1/ep of them), and their adapters (PEFT): part
    of block_matmul."""
    block_routed_adapters: int
    """PEFT: of block_experts, the routed experts' adapters (what trains of them)."""
    block_no_decay: int
    mlp_out: int
    embedding: int
    head: int
    """Final norm, plus the output projection unless it is the embedding on this same rank."""
    output_matmul: int
    tied_here: bool
    tensors: int
    largest_tensor: int
    trainable: int = -1
    """Parameters the optimizer updates on the rank (PEFT: the adapters, and the embedding or output
    projection where asked; peft/spec.py); -1: all of them."""
    block_nf4: int = 0
    """QLoRA: the elements of block_matmul held in NF4 (peft/spec.py's Adaptation.quantized), which
    autocast does not cast and FSDP2 gathers as NF4."""
    block_nf4_bytes: int = 0
    """Their bytes in NF4 (spec.nf4_bytes), whole."""
    summed: BlockParams | None = None
    """Every block of the rank's BlockParams added up, field by field: what a sum over its blocks reads
    (the block_* fields are the block at the step's moments: the stage's last, the first backwarded)."""
    kind_blocks: tuple[int, ...] = ()
    """The rank's blocks of each kind of layer (LayoutCommon.kinds)..."""
    kind_policy_blocks: tuple[int, ...] = ()
    """...and of those, the blocks the checkpointing policy wraps."""
    moment_kind: int = 0
    """The kind of the stage's last block, whose sizes the block_* fields and the step's moments read."""
    block_order: tuple[tuple[int, bool], ...] = ()
    """Each of the rank's blocks in model order: its kind and whether the checkpointing policy wraps it
    (where a backward moment of a block in the middle of the stage falls: step_peak.py)."""

    def of_kind(self, block: BlockParams, kind: int) -> RankLayout:
        """The same rank with the block_* fields of a block of `kind` (sizes `block`)."""
        return self._replace(moment_kind=kind, **_block_fields(block))


def _block_fields(b: BlockParams) -> dict[str, int]:
    """RankLayout's fields of one block, from its BlockParams."""
    return dict(block=b.params, block_matmul=b.matmul, block_experts=b.experts, block_routed_adapters=b.routed_adapters,
                block_float8=b.float8, block_no_decay=b.no_decay, mlp_out=b.mlp_out, block_nf4=b.nf4,
                block_nf4_bytes=b.nf4_bytes)


def _block(run: Run) -> BlockParams:
    """A block's BlockParams on a rank of `run`'s layout: once per model and what it reads of the layout (the
    planner estimates thousands of layouts of a few tp and ep degrees)."""
    layout = run.layout
    return _block_of(config_key(run.model), layout.tp, layout.ep, layout.precision == "fp8-mixed", layout.adaptation)


@functools.lru_cache(maxsize=1024)
def _block_of(model_key: tuple, tp: int, ep: int, fp8: bool, adaptation: Adaptation | None) -> BlockParams:
    m = ModelConfig(*model_key)
    counts = param_counts(m)
    # Each linear as tensor and expert parallelism split it (models/block_spec.py: an MoE
    # feed-forward whole on the tp ranks, its routed experts / ep; a row-parallel bias whole); norm
    # gains stay whole.
    linears = block_linears(m)
    matmul = sum(linear.local_params(tp, ep) for linear in linears)
    mlp = sum(linear.local_params(tp, ep) for linear in linears if linear.path.startswith("feed_forward."))
    layer = describe(m).block
    biases = sum(linear.out_features for linear in linears if linear.bias)
    norm_tensors = 2 if layer.norm.kind == "layer" else 1  # gain (and bias) of one norm
    # the stream's norms, each linear's weight (a routed expert's stacked weight: one) and bias, QK-norm's gains
    tensors = layer.stream_norms * norm_tensors + sum(1 + linear.bias for linear in linears) + \
        2 * bool(layer.attention.qk_norm)
    w2 = {linear.name: linear for linear in linears}.get("w2")
    mlp_out = w2.in_features * w2.out_features // tp if w2 and not layer.mlp.gated else mlp // 3
    experts_local = max(1, m.num_experts // ep) * (m.expert_ffn_dim or 0) * m.dim
    adapters = adapter_params(m, adaptation, ep) if adaptation else 0
    routed_adapters = routed_adapter_params(m, adaptation, ep) if adaptation else 0
    magnitudes = adapter_magnitudes(m, adaptation) if adaptation else 0
    in_nf4 = [linear.in_features * linear.out_features for linear in linears
              if adaptation and linear.name in adaptation.quantized]  # tp = 1 with PEFT
    return BlockParams(
        nf4=sum(in_nf4), nf4_bytes=sum(nf4_bytes(n) for n in in_nf4),
        params=matmul + adapters + counts.norms, matmul=matmul + adapters - magnitudes, adapters=adapters,
        float8=sum(k * n + b for k, n, b in float8_linears(m).values()) // tp if fp8 else 0,
        experts=counts.routed_experts // ep + routed_adapters, routed_adapters=routed_adapters,
        no_decay=counts.norms + biases // tp + magnitudes, mlp_out=mlp_out,
        tensors=tensors + (2 + bool(magnitudes)) * len(adaptation.targets) if adaptation else tensors,
        norm_tensors=norm_tensors, vocab=m.vocab_size * m.dim // tp,
        largest=max(m.dim * layer.attention.q_dim // tp, m.ffn_dim * m.dim // tp, experts_local))


@functools.lru_cache(maxsize=1024)
def _added(blocks: tuple[tuple[int, BlockParams], ...]) -> BlockParams:
    """Count x BlockParams, added up field by field (once per rank shape: the planner's layouts repeat them)."""
    return BlockParams(*(sum(n * getattr(b, f) for n, b in blocks) for f in BlockParams._fields))


class _BlockOrder(NamedTuple):
    """A rank's blocks by kind and checkpointing (RankLayout's block_order and what it counts)."""

    order: tuple[tuple[int, bool], ...]
    policy_blocks: int
    kind_blocks: tuple[int, ...]
    kind_policy: tuple[int, ...]


@functools.lru_cache(maxsize=4096)
def _block_order(kind_of: tuple[int, ...], kinds: int, blocks: tuple[int, ...], wraps: bool, every: int
                 ) -> _BlockOrder:
    """The blocks' (kind, wrapped) in model order, and their counts, once per rank (the planner estimates the
    same ranks under many layouts: a walk over up to every block of the model each time)."""
    order = tuple((kind_of[i], wraps and checkpointed(i, every)) for i in blocks)
    return _BlockOrder(order, sum(wrapped for _, wrapped in order),
                       tuple(sum(kind == k for kind, _ in order) for k in range(kinds)),
                       tuple(sum(kind == k and wrapped for kind, wrapped in order) for k in range(kinds)))


def rank_layout(run: Run, common: LayoutCommon, place: RankPlacement) -> RankLayout:
    m, mem = run.model, run.layout
    first, last, blocks = place.first, place.last, place.blocks  # blocks: global indices, model order
    n = mem.ac_every_n_layers
    kinds = range(len(common.kinds))
    order, policy_blocks, kind_blocks, kind_policy = _block_order(
        common.kind_of, len(kinds), blocks, mem.activation_checkpointing != "none", n)
    moment = common.kind_of[blocks[-1]] if blocks else 0
    b = common.kinds[moment].block
    summed = _added(tuple((kind_blocks[k], common.kinds[k].block) for k in kinds))
    tied_here = first and last and bool(m.tie_embeddings)
    head = common.counts.final_norm + (0 if tied_here else b.vocab) if last else 0
    tensors = summed.tensors + b.norm_tensors * first  # + pos embedding (gpt2)
    tensors += (b.norm_tensors + (0 if tied_here else 1)) * last
    in_flight, head_in_flight = mem.micro_batches_in_flight(place.rank)
    adaptation, embedding = mem.adaptation, common.counts.embedding // mem.tp if first else 0
    trainable = -1 if adaptation is None else (
        summed.adapters + (embedding if adaptation.train_embeddings else 0)
        + (b.vocab if last and adaptation.train_output and not tied_here else 0))
    return RankLayout(
        blocks=len(blocks), policy_blocks=policy_blocks,
        last_wrapped=policy_blocks > 0 and checkpointed(blocks[-1], n),
        first_wrapped=policy_blocks > 0 and checkpointed(blocks[0], n),
        in_flight=in_flight, head_in_flight=head_in_flight, first=first, last=last,
        embedding=common.counts.embedding // mem.tp if first else 0,
        head=head, output_matmul=b.vocab if last else 0, tied_here=tied_here, tensors=tensors,
        largest_tensor=max(b.vocab if (first or last) else 0, *(kind.block.largest for kind in common.kinds)),
        trainable=trainable, summed=summed, kind_blocks=kind_blocks,
        kind_policy_blocks=kind_policy, moment_kind=moment,
        block_order=order, **_block_fields(b),
    )


class KindSizes(NamedTuple):
    """One kind of layer's sizes (architecture.layer_kinds): its run (the model of that kind of layer
    only), a block's parameters and a micro-batch's activations."""

    run: Run
    counts: ParamCounts
    block: BlockParams
    micro_batch: MicroBatch


class LayoutCommon(NamedTuple):
    """What every pipeline rank of a layout shares, computed once per estimate (the planner
    estimates thousands of layouts of up to 64 ranks each)."""

    counts: ParamCounts
    prec: Precision
    fsdp: bool
    """ZeRO-2/3 and CPU offload are FSDP2 (offload moves the sharded parameters, their gradients
    and the optimizer to the host together); ZeRO-0 is DDP, ZeRO-1 parallel/zero.py's engine."""
    tokens: int
    """Tokens of one micro-batch on the rank (its local sequences)."""
    seq: int
    block: BlockParams
    micro_batch: MicroBatch
    comm_buffers: int
    """NCCL's communicator buffers on any rank (memory/closed_form/comm_buffers.py; 0 on the CPU)."""
    kinds: tuple[KindSizes, ...] = ()
    """Each kind of layer's sizes; block, micro_batch and counts above are the first kind's (the model's
    own where its layers are alike; `at_moment` gives a rank's)."""
    kind_of: tuple[int, ...] = ()
    """Each layer's kind."""

    def at_moment(self, lay: RankLayout) -> tuple[Run, LayoutCommon]:
        """The run and sizes the step's moments on a rank of `lay` read: its last block's kind's."""
        run, common, _ = self.at_kind(lay, lay.moment_kind)
        return run, common

    def at_kind(self, lay: RankLayout, k: int) -> tuple[Run, LayoutCommon, RankLayout]:
        """The run, sizes and rank a block of kind `k` on a rank of `lay` reads."""
        kind = self.kinds[k]
        common = self._replace(counts=kind.counts, block=kind.block, micro_batch=kind.micro_batch)
        return kind.run, common, lay if k == lay.moment_kind else lay.of_kind(kind.block, k)

    def per_kind(self, lay: RankLayout, size: Callable[[Run, KindSizes], float], wrapped: bool | None = None) -> float:
        """A per-block size summed over the rank's blocks, each of its kind: all of them, or only those the
        checkpointing policy wraps (wrapped=True) or leaves (False)."""
        def blocks(k: int) -> int:
            wraps = lay.kind_policy_blocks[k]
            return lay.kind_blocks[k] if wrapped is None else wraps if wrapped else lay.kind_blocks[k] - wraps

        return sum(blocks(k) * size(kind.run, kind) for k, kind in enumerate(self.kinds) if blocks(k))


def layout_common(run: Run, shared: SharedSizes) -> LayoutCommon:
    layout = run.layout
    fsdp = layout.data_parallel == "fsdp"
    prec = precision_of(layout.precision, not layout.autocast)
    if assumed_attention_kernel(run.model, layout, run.training, run.hardware) == "math":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, math_attention=True))
    if eager_attention(describe(run.model).attention, device_type(run.hardware)):
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, eager_attention=True))
    if run.hardware.gpu == "cpu":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, dropout_noise=True))
    if layout.rows is not None and layout.rows.packed:
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, packed_rows=True))
    seq = run.training.seq_len // layout.cp
    tokens = layout.micro_batch_size * seq
    shape = MicroBatchShape(tokens, seq, layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
                   layout.activation_checkpointing, layout.moe_imbalance, layout.chunked_loss, layout.loss_chunk_tokens,
                   rope_table_bytes(run), layout.adaptation,
                   layout.rows.scored_share(run.training.seq_len) if layout.rows is not None else 1.0,
                   document_mask_kernel(device_type(run.hardware), describe(run.model).sinks)
                   if prec.act.packed_rows else "",
                   layout.regathers, run.engine.layers, layout.precision == "fp8-mixed")
    kinds = tuple(KindSizes(kind_run, sizes.counts, _block(kind_run), sizes.micro_batch(prec, shape))
                  for sizes in shared.kinds for kind_run in [run._replace(model=sizes.model)])
    first = kinds[0]
    return LayoutCommon(first.counts, prec, fsdp, tokens, seq, first.block, first.micro_batch,
                        comm_buffer_bytes(run.model, run.layout, run.hardware), kinds, kind_of_layers(run.model))


def _frozen_first_block(layout: Layout, lay: RankLayout) -> Adaptation | None:
    """The Adaptation when the rank holds the first block unwrapped and the embedding is frozen."""
    adaptation = layout.adaptation
    if adaptation is None or adaptation.train_embeddings or not lay.first or lay.first_wrapped:
        return None
    return adaptation


def first_block_saving(run: Run, lay: RankLayout, d: ActDtypes) -> int:
    """Bytes of one micro-batch the rank's first block does not save under PEFT (first_block_terms)."""
    adaptation = _frozen_first_block(run.layout, lay)
    if adaptation is None:
        return 0
    terms = first_block_terms(run.model, d, adaptation)
    return terms.bytes(_tokens(run), run.training.seq_len // run.layout.cp)


def first_block_casts_unsaved(run: Run, lay: RankLayout, d: ActDtypes) -> int:
    """Elements of the rank's first block whose autocast casts are not saved (first_block_unsaved_casts)."""
    adaptation = _frozen_first_block(run.layout, lay)
    return first_block_unsaved_casts(run.model, adaptation) if adaptation is not None and d.autocast else 0


def _tokens(run: Run) -> int:
    return run.layout.micro_batch_size * run.training.seq_len // run.layout.cp
