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
  its magnitude scales; dropout keeps each adapter's own dropped input and its mask (ActDtypes.dropout_mask).
SDPA keeps its output, which is also the output projection's input (a view): a frozen wo changes
nothing there, except under the math kernel, where wo saves its own contiguous copy. A frozen MoE
(moe_activations.py) keeps neither its routed rows' inputs nor their SwiGLU products, nor the
router's and shared experts' inputs, but what its experts' adapters keep (the same rules, per routed
row).
"""

from __future__ import annotations

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    FP32,
    ActDtypes,
    Terms,
    block_shapes,
    layer_of,
    normed_bytes,
    scores_kept,
    ungated_mlp,
)
from trainfit.memory.closed_form.block.attention_activations import attention_saved
from trainfit.memory.closed_form.block.moe_activations import Routing, balanced_routing
from trainfit.models.block_spec import block_linears
from trainfit.peft.spec import Adaptation


def adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation, routing: Routing | None = None) -> Terms:
    """What an adapted block saves beyond (positive) or short of (negative) full fine-tuning's
    block_terms(policy='none'), per token (an MoE's routed experts: per `routing` row)."""
    D, q_dim, _, _, _ = block_shapes(m)
    c, a = d.compute, d.stream
    adapted = set(adaptation.targets)
    linears = {linear.name: linear for linear in block_linears(m)}
    gpt2 = ungated_mlp(m)
    layer = layer_of(m)
    # the RMSNorms' normalized copies, kept only for their gains (before a branch: in the stream's dtype,
    # after one: in its output's; Gemma's (1 + w): in fp32); so are QK-norm's (frozen too)
    before = 2.0 * normed_bytes(m, a) * D if layer.norm_placement != "post" else 0.0
    after = (normed_bytes(m, c) + normed_bytes(m, a if m.num_experts else c)) * D \
        if layer.norm_placement != "pre" else 0.0
    seq = 0 if layer.norm.kind == "layer" else -(before + after)
    qk_norm = -normed_bytes(m, c) * (layer.attention.q_dim + layer.attention.kv_dim) if layer.attention.qk_norm else 0
    gathered = 0.0
    moe = bool(m.num_experts)
    ffn_consumers = ("w1",) if gpt2 else ("router", *("shared_w1", "shared_w3") * bool(m.num_shared_experts)) \
        if moe else ("w1", "w3")
    for consumers in (("wq", "wk", "wv"), ffn_consumers):
        gathered += _inputs_kept(consumers, adapted, d, D, adaptation.dropout) - \
            (len(consumers) * c * D if d.autocast else a * D)
    if moe:
        gathered += _moe_adapter_terms(m, d, adaptation, routing or balanced_routing(m))
    ffn = 0 if moe else m.ffn_dim
    # the down projection's input (SwiGLU's product, GELU's output), kept for its adapter's A, or with
    # dropout its dropped copy and mask instead
    tp = -c * ffn + _inputs_kept(("w2",), adapted, d, ffn, adaptation.dropout) + qk_norm
    if scores_kept(m, d) and "wo" not in adapted:
        tp -= c * q_dim  # wo's contiguous copy of the output
    if adaptation.dropout and "wo" in adapted:  # beside SDPA's output, which it keeps anyway
        tp += (c + d.dropout_mask(c)) * q_dim
    for name in adapted - set(ROUTED):
        gathered += c * adaptation.rank + (c * linears[name].out_features if adaptation.dora else 0)
    if adaptation.dora and d.autocast and not gpt2 and not moe:
        # DoRA's fp32 magnitude makes its linear's output fp32: SiLU keeps its fp32 input and output (w1),
        # the product its fp32 operand (w3), where bf16 ones were kept
        tp += (FP32 - c) * ffn * (2 * ("w1" in adapted) + ("w3" in adapted))
    return Terms(seq=seq, gathered=gathered, tp=tp)


ROUTED = ("experts_w1", "experts_w3", "experts_w2")
"""The routed experts' stacked weights (models/block_spec.py names)."""


def _inputs_kept(consumers: tuple[str, ...], adapted: set[str], d: ActDtypes, width: int, dropout: bool) -> float:
    """Bytes per row autograd keeps of one input read by `consumers` (linears), of which the frozen
    ones keep nothing and each adapted one's A keeps it: under autocast its own 16-bit cast; else the
    one input, shared; with dropout each its own dropped copy and mask instead (the block input's in
    the stream's dtype; the inputs of wo and w2 are matmul outputs, in the compute dtype, which the
    stream's equals outside autocast)."""
    mine = [n for n in consumers if n in adapted]
    if dropout:
        source = d.compute if mine and mine[0] in ("wo", "w2", *ROUTED[2:], "shared_w2") else d.stream
        return len(mine) * ((d.compute if d.autocast else d.stream) + d.dropout_mask(source)) * width
    return len(mine) * d.compute * width if d.autocast else d.stream * width * bool(mine)


def _moe_adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation, routing: Routing) -> Terms | float:
    """An MoE feed-forward under PEFT (the router never adapted), against full fine-tuning's: each
    routed expert row keeps its input only for adapters on w1 or w3, SwiGLU's product only for one
    on w2, and A x per adapter (rank wide); the shared experts keep their product only for an adapter
    on their w2. Per token; the routed rows are `routing.rows` per token (top-k dropless, the
    capacity buffers' slots, expert parallelism's received rows)."""
    D, F, c, a = m.dim, m.expert_ffn_dim, d.compute, d.stream
    adapted = set(adaptation.targets)
    full_row = (2 * c * D if d.autocast else a * D) + c * F
    row = _inputs_kept(ROUTED[:2], adapted, d, D, adaptation.dropout) \
        + _inputs_kept(ROUTED[2:], adapted, d, F, adaptation.dropout) if d.autocast or adaptation.dropout \
        else _inputs_kept(ROUTED[:2], adapted, d, D, False) + c * F * ("experts_w2" in adapted)
    row += c * adaptation.rank * len(adapted & set(ROUTED))
    shared = m.num_shared_experts * F
    shared_kept = _inputs_kept(("shared_w2",), adapted, d, shared, adaptation.dropout) if adaptation.dropout \
        else c * shared * ("shared_w2" in adapted)
    return routing.rows * (row - full_row) + shared_kept - c * shared


def first_block_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation) -> Terms:
    """What the first block does not save when the embedding is frozen, beyond adapter_terms: its
    input needs no gradient, so its first norm keeps neither the input (RMSNorm: its fp32 copy) nor
    the statistics (RMSNorm's rsqrt; LayerNorm's mean and rstd), what needs a gradient starting at
    the adapters' outputs. Without an adapter on q, k or v the attention keeps nothing either (but
    its output, if wo's adapter reads it), and without one on the attention at all, nor does the
    second norm. The dropout on q, k and v's adapters keeps no mask there."""
    D, q_dim, _, _, _ = block_shapes(m)
    norm = d.stream * D + 2 * d.stream if layer_of(m).norm.kind == "layer" else FP32 * D + FP32
    adapted = set(adaptation.targets)
    if adapted & {"wq", "wk", "wv"}:
        # dropout of an input needing no gradient keeps no mask (its dropped copy, A's input, stays)
        masks = d.dropout_mask(d.stream) * D * len(adapted & {"wq", "wk", "wv"}) if adaptation.dropout else 0
        return Terms(seq=norm, gathered=masks)
    attention = attention_saved(m, d, 1) + Terms(tp=-d.compute * q_dim * ("wo" in adapted))
    second = Terms() if "wo" in adapted else Terms(seq=norm)
    return Terms(seq=norm) + attention + second


def final_norm_adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation, projected: bool) -> Terms:
    """What PEFT changes in stage_activations.final_norm_terms: a frozen final norm gain keeps no
    normalized copy (RMSNorm), and a frozen output projection not its input (the norm's output).
    (Under the chunked loss, what its chunks keep through a frozen projection is not modelled yet:
    logits.py counts full fine-tuning's.)"""
    gain = 0.0 if layer_of(m).norm.kind == "layer" else d.stream * m.dim
    head = (d.compute if d.autocast else d.stream) * m.dim if projected and not adaptation.train_output else 0.0
    return Terms(seq=-gain, gathered=-head)


def first_block_unsaved_casts(m: ModelConfig, adaptation: Adaptation) -> int:
    """Under autocast, the first block's weights whose 16-bit casts autograd does not save when the
    embedding is frozen (a frozen weight's cast is kept only for its input's gradient): wq, wk and wv
    always (their input needs none), wo without an adapter on q, k or v, the MLP's first linears
    without any on the attention. Elements. (QLoRA's NF4 weights are never cast: not among them.)"""
    if adaptation.train_embeddings:
        return 0
    sizes = {linear.name: linear.copies * linear.in_features * linear.out_features
             * (linear.name not in adaptation.quantized) for linear in block_linears(m)}
    adapted = set(adaptation.targets)
    unsaved = sizes["wq"] + sizes["wk"] + sizes["wv"]
    if not adapted & {"wq", "wk", "wv"}:
        unsaved += sizes["wo"]
        if "wo" not in adapted:
            unsaved += sum(sizes.get(n, 0) for n in ("w1", "w3", "router", "shared_w1", "shared_w3", "experts_w1",
                                                     "experts_w3"))
    return unsaved


def selective_adapter_terms(m: ModelConfig, d: ActDtypes, adaptation: Adaptation, routing: Routing | None = None
                            ) -> Terms:
    """Selective checkpointing keeps matmul outputs: each adapter's A x and B A x beside the block's
    (a routed expert's per routed row)."""
    linears = {linear.name: linear for linear in block_linears(m)}
    rows = (routing or balanced_routing(m)).rows if m.num_experts else 1.0
    return Terms(gathered=sum(d.compute * (adaptation.rank + linears[n].out_features) * (rows if n in ROUTED else 1)
                              for n in adaptation.targets))


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
