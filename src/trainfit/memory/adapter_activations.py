"""What PEFT changes in what a block saves for backward (peft/spec.py's adapters on a frozen base):
`adapter_terms`, the difference from the block's full fine-tuning terms (activations.block_terms,
no checkpointing), for a block whose input needs a gradient. Torch-free.

From first principles of autograd, which saves an operand only for the gradient of another operand
that needs one (read off our blocks with saved_tensors_hooks, as activation_terms.py's figures):
- a frozen linear saves nothing for its weight: its input is kept only if an adapter on it keeps it
  (LoRA's A multiplies the same input, and saves it, or its own dropped-out copy);
- a frozen norm gain needs no gradient: RMSNorm's normalized copy (kept for the gain) goes;
- under autocast every adapted linear's A casts the input itself (a frozen W's cast is saved for the
  input's gradient, but that is the weight, a parameter's cast: the step's params counts it);
- each adapter keeps A x (rank wide) for B's gradient; DoRA keeps W x + s B A x too (out wide), which
  its magnitude scales; dropout keeps each adapter's own dropped input and its mask.
SDPA keeps its output, which is also the output projection's input (a view): a frozen wo changes
nothing there, except under the math kernel, where wo saves its own contiguous copy. A frozen MoE
(moe_activations.py) keeps neither its routed rows' inputs nor their SwiGLU products, nor the
router's and shared experts' inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainfit.config import ModelConfig
from trainfit.memory.activation_terms import FP32, ActDtypes, Terms, block_shapes
from trainfit.memory.attention_activations import attention_saved
from trainfit.models.block_spec import block_linears
from trainfit.peft.spec import Adaptation

if TYPE_CHECKING:
    from trainfit.memory.rank_layout import RankLayout
    from trainfit.memory.run_shape import Run
    from trainfit.parallel.layout import Layout

DROPOUT_MASK_BYTES = 1
"""torch's native_dropout keeps a bool mask per element."""


def adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation) -> Terms:
    """What an adapted block saves beyond (positive) or short of (negative) full fine-tuning's
    block_terms(policy='none'), per token."""
    D, q_dim, _, _, _ = block_shapes(m)
    c, a = d.compute, d.stream
    adapted = set(adaptation.targets)
    linears = {linear.name: linear for linear in block_linears(m)}
    gpt2 = m.family == "gpt2"
    seq = 0 if gpt2 else -2.0 * a * D  # the two RMSNorms' normalized copies, kept only for their gains
    gathered = 0.0
    moe = bool(m.num_experts)
    ffn_consumers = ("w1",) if gpt2 else ("router", *("shared_w1", "shared_w3") * bool(m.num_shared_experts)) \
        if moe else ("w1", "w3")
    for consumers in (("wq", "wk", "wv"), ffn_consumers):
        full = len(consumers) * c * D if d.autocast else a * D
        mine = [n for n in consumers if n in adapted]
        if adaptation.dropout:
            kept = len(mine) * ((c if d.autocast else a) + DROPOUT_MASK_BYTES) * D
        else:
            kept = len(mine) * c * D if d.autocast else a * D * bool(mine)
        gathered += kept - full
    if moe:  # a frozen MoE (peft.targets refuse its linears): no expert keeps its input or SwiGLU's product
        x_in = 2 * c * D if d.autocast else a * D
        gathered -= m.experts_per_token * (x_in + c * m.expert_ffn_dim) \
            + c * m.num_shared_experts * m.expert_ffn_dim
    ffn = 0 if moe else m.ffn_dim
    tp = 0.0 if "w2" in adapted else -c * ffn  # the down projection's input (SwiGLU's product, GELU's output)
    if d.math_attention and "wo" not in adapted:
        tp -= c * q_dim  # wo's contiguous copy of the output
    for name, width in (("wo", q_dim), ("w2", ffn)):
        if adaptation.dropout and name in adapted:
            tp += (c + DROPOUT_MASK_BYTES) * width
    for name in adapted:
        gathered += c * adaptation.rank + (c * linears[name].out_features if adaptation.dora else 0)
    if adaptation.dora and d.autocast and not gpt2 and not moe:
        # DoRA's fp32 magnitude makes its linear's output fp32: SiLU keeps its fp32 input and output (w1),
        # the product its fp32 operand (w3), where bf16 ones were kept
        tp += (FP32 - c) * ffn * (2 * ("w1" in adapted) + ("w3" in adapted))
    return Terms(seq=seq, gathered=gathered, tp=tp)


def first_block_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation) -> Terms:
    """What the first block does not save when the embedding is frozen, beyond adapter_terms: its
    input needs no gradient, so its first norm keeps neither the input (RMSNorm: its fp32 copy) nor
    the statistics (RMSNorm's rsqrt; LayerNorm's mean and rstd), what needs a gradient starting at
    the adapters' outputs. Without an adapter on q, k or v the attention keeps nothing either (but
    its output, if wo's adapter reads it), and without one on the attention at all, nor does the
    second norm."""
    D, q_dim, _, _, _ = block_shapes(m)
    norm = d.stream * D + 2 * d.stream if m.family == "gpt2" else FP32 * D + FP32
    adapted = set(adaptation.targets)
    if adapted & {"wq", "wk", "wv"}:
        return Terms(seq=norm)
    attention = attention_saved(m, d, 1) + Terms(tp=-d.compute * q_dim * ("wo" in adapted))
    second = Terms() if "wo" in adapted else Terms(seq=norm)
    return Terms(seq=norm) + attention + second


def final_norm_adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation, projected: bool) -> Terms:
    """What PEFT changes in stage_activations.final_norm_terms: a frozen final norm gain keeps no
    normalized copy (RMSNorm), and a frozen output projection not its input (the norm's output).
    (Under the chunked loss, what its chunks keep through a frozen projection is not modelled yet:
    logits.py counts full fine-tuning's.)"""
    gain = 0.0 if m.family == "gpt2" else d.stream * m.dim
    head = (d.compute if d.autocast else d.stream) * m.dim if projected and not adaptation.train_output else 0.0
    return Terms(seq=-gain, gathered=-head)


def first_block_unsaved_casts(m: ModelConfig, adaptation: Adaptation) -> int:
    """Under autocast, the first block's weights whose 16-bit casts autograd does not save when the
    embedding is frozen (a frozen weight's cast is kept only for its input's gradient): wq, wk and wv
    always (their input needs none), wo without an adapter on q, k or v, the MLP's first linears
    without any on the attention. Elements. (QLoRA's NF4 weights are never cast: not among them.)"""
    if adaptation.train_embeddings:
        return 0
    sizes = {linear.name: linear.in_features * linear.out_features * (linear.name not in adaptation.quantized)
             for linear in block_linears(m)}
    adapted = set(adaptation.targets)
    unsaved = sizes["wq"] + sizes["wk"] + sizes["wv"]
    if not adapted & {"wq", "wk", "wv"}:
        unsaved += sizes["wo"]
        if "wo" not in adapted:
            unsaved += sum(sizes.get(n, 0) for n in ("w1", "w3", "router", "shared_w1", "shared_w3"))
    return unsaved


def selective_adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation) -> Terms:
    """Selective checkpointing keeps matmul outputs: each adapter's A x and B A x beside the block's."""
    linears = {linear.name: linear for linear in block_linears(m)}
    return Terms(gathered=sum(d.compute * (adaptation.rank + linears[n].out_features) for n in adaptation.targets))


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
    return terms.bytes(lay_tokens(run), run.training.seq_len // run.layout.cp)


def first_block_casts_unsaved(run: Run, lay: RankLayout, d: ActDtypes) -> int:
    """Elements of the rank's first block whose autocast casts are not saved (first_block_unsaved_casts)."""
    adaptation = _frozen_first_block(run.layout, lay)
    return first_block_unsaved_casts(run.model, adaptation) if adaptation is not None and d.autocast else 0


def lay_tokens(run: Run) -> int:
    return run.layout.micro_batch_size * run.training.seq_len // run.layout.cp


NF4_DEQUANT_BYTES_PER_WEIGHT = 14
"""torchao's NF4Tensor.get_original_weight (eager), bytes per weight at its peak: the two 4-bit halves
of each byte widened to int64 codebook indices (8: two int64 per two weights), their bf16 levels (2),
those scaled by their blocks' scales (2), and the two interleaved into the bf16 weight (2). All alive
as it returns; then the bf16 weight alone (2, or 2 + 4 while cast to an fp32 input's dtype)."""


def nf4_dequant_bytes(m: ModelConfig, adaptation: Adaptation | None) -> int:
    """QLoRA: the working set of dequantizing the largest NF4 weight of a block, which every forward
    and backward (input gradient) of an NF4 linear builds and frees around its matmul (peft/nf4.py).
    Eager; a compiled step fuses it into fewer tensors, so this bounds it."""
    if adaptation is None or not adaptation.quantized:
        return 0
    return NF4_DEQUANT_BYTES_PER_WEIGHT * max(linear.in_features * linear.out_features
                                             for linear in block_linears(m) if linear.name in adaptation.quantized)
