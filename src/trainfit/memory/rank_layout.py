"""What one rank of a pipeline stage holds, in element counts after tensor and expert parallelism
(`RankLayout`): its blocks, which of them the checkpointing policy wraps, its ends (embedding, head), the
micro-batches in flight; and what every rank of a layout shares (`LayoutCommon`: dtypes, a block's parameters,
a micro-batch's sizes), computed once per estimate. The inputs of every per-rank term. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from trainfit.hardware import device_type
from trainfit.memory.comm_buffers import comm_buffer_bytes
from trainfit.memory.micro_batch import MicroBatch, SharedSizes
from trainfit.memory.pipeline_held import micro_batches_in_flight
from trainfit.memory.run_shape import (
    MicroBatchShape,
    Precision,
    Run,
    assumed_attention_kernel,
    precision_of,
    rope_table_bytes,
)
from trainfit.models.architecture import describe, softcap_kernel
from trainfit.models.block_spec import block_linears
from trainfit.models.params import ParamCounts
from trainfit.parallel.stage_split import RankPlacement, checkpointed
from trainfit.peft.spec import adapter_magnitudes, adapter_params, nf4_bytes, routed_adapter_params
from trainfit.perf.fp8_casts import float8_linears


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


def _block(run: Run, counts: ParamCounts) -> BlockParams:
    m, tp, ep = run.model, run.layout.tp, run.layout.ep
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
    adaptation = run.layout.adaptation
    adapters = adapter_params(m, adaptation, ep) if adaptation else 0
    routed_adapters = routed_adapter_params(m, adaptation, ep) if adaptation else 0
    magnitudes = adapter_magnitudes(m, adaptation) if adaptation else 0
    in_nf4 = [linear.in_features * linear.out_features for linear in linears
              if adaptation and linear.name in adaptation.quantized]  # tp = 1 with PEFT
    return BlockParams(
        nf4=sum(in_nf4), nf4_bytes=sum(nf4_bytes(n) for n in in_nf4),
        params=matmul + adapters + counts.norms, matmul=matmul + adapters - magnitudes, adapters=adapters,
        float8=sum(k * n + b for k, n, b in float8_linears(m).values()) // tp
        if run.layout.precision == "fp8-mixed" else 0,
        experts=counts.routed_experts // ep + routed_adapters, routed_adapters=routed_adapters,
        no_decay=counts.norms + biases // tp + magnitudes, mlp_out=mlp_out,
        tensors=tensors + (2 + bool(magnitudes)) * len(adaptation.targets) if adaptation else tensors,
        norm_tensors=norm_tensors, vocab=m.vocab_size * m.dim // tp,
        largest=max(m.dim * layer.attention.q_dim // tp, m.ffn_dim * m.dim // tp, experts_local))


def rank_layout(run: Run, common: LayoutCommon, place: RankPlacement) -> RankLayout:
    m, mem, b = run.model, run.layout, common.block
    first, last, blocks = place.first, place.last, place.blocks  # blocks: global indices, model order
    n = mem.ac_every_n_layers
    policy_blocks = sum(checkpointed(i, n) for i in blocks) if mem.activation_checkpointing != "none" else 0
    tied_here = first and last and bool(m.tie_embeddings)
    head = common.counts.final_norm + (0 if tied_here else b.vocab) if last else 0
    tensors = len(blocks) * b.tensors + b.norm_tensors * first  # + pos embedding (gpt2)
    tensors += (b.norm_tensors + (0 if tied_here else 1)) * last
    in_flight, head_in_flight = micro_batches_in_flight(run, place.rank)
    adaptation, embedding = mem.adaptation, common.counts.embedding // mem.tp if first else 0
    trainable = -1 if adaptation is None else (
        len(blocks) * b.adapters + (embedding if adaptation.train_embeddings else 0)
        + (b.vocab if last and adaptation.train_output and not tied_here else 0))
    return RankLayout(
        blocks=len(blocks), policy_blocks=policy_blocks,
        last_wrapped=policy_blocks > 0 and checkpointed(blocks[-1], n),
        first_wrapped=policy_blocks > 0 and checkpointed(blocks[0], n),
        in_flight=in_flight, head_in_flight=head_in_flight, first=first, last=last,
        block=b.params, block_matmul=b.matmul, block_experts=b.experts, block_routed_adapters=b.routed_adapters,
        block_float8=b.float8,
        block_no_decay=b.no_decay, mlp_out=b.mlp_out, embedding=common.counts.embedding // mem.tp if first else 0,
        head=head, output_matmul=b.vocab if last else 0, tied_here=tied_here, tensors=tensors,
        largest_tensor=max(b.vocab if (first or last) else 0, b.largest), trainable=trainable,
        block_nf4=b.nf4, block_nf4_bytes=b.nf4_bytes,
    )


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
    """NCCL's communicator buffers on any rank (memory/comm_buffers.py; 0 on the CPU)."""


def layout_common(run: Run, shared: SharedSizes) -> LayoutCommon:
    layout = run.layout
    fsdp = layout.data_parallel == "fsdp"
    prec = precision_of(layout.precision, not layout.autocast)
    if assumed_attention_kernel(run.model, layout, run.training, run.hardware) == "math":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, math_attention=True))
    if describe(run.model).block.attention.softcap and softcap_kernel(device_type(run.hardware)) == "eager":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, eager_attention=True))
    if run.hardware.gpu == "cpu":
        prec = dataclasses.replace(prec, act=dataclasses.replace(prec.act, dropout_noise=True))
    seq = run.training.seq_len // layout.cp
    tokens = layout.micro_batch_size * seq
    shape = MicroBatchShape(tokens, seq, layout.tp, layout.cp, layout.ep, layout.sequence_parallel,
                   layout.activation_checkpointing, layout.moe_imbalance, layout.chunked_loss, layout.loss_chunk_tokens,
                   rope_table_bytes(run), layout.adaptation)
    return LayoutCommon(shared.counts, prec, fsdp, tokens, seq, _block(run, shared.counts),
                        shared.micro_batch(prec, shape), comm_buffer_bytes(run.model, run.layout, run.hardware))
