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
nothing there, except under the math kernel, where wo saves its own contiguous copy.
"""

from __future__ import annotations

from trainfit.config import ModelConfig
from trainfit.memory.activation_terms import FP32, ActDtypes, Terms, block_shapes
from trainfit.models.block_spec import block_linears
from trainfit.peft.spec import Adaptation

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
    for consumers in (("wq", "wk", "wv"), ("w1",) if gpt2 else ("w1", "w3")):
        full = len(consumers) * c * D if d.autocast else a * D
        mine = [n for n in consumers if n in adapted]
        if adaptation.dropout:
            kept = len(mine) * ((c if d.autocast else a) + DROPOUT_MASK_BYTES) * D
        else:
            kept = len(mine) * c * D if d.autocast else a * D * bool(mine)
        gathered += kept - full
    ffn = m.ffn_dim
    tp = 0.0 if "w2" in adapted else -c * ffn  # the down projection's input (SwiGLU's product, GELU's output)
    if d.math_attention and "wo" not in adapted:
        tp -= c * q_dim  # wo's contiguous copy of the output
    for name, width in (("wo", q_dim), ("w2", ffn)):
        if adaptation.dropout and name in adapted:
            tp += (c + DROPOUT_MASK_BYTES) * width
    for name in adapted:
        gathered += c * adaptation.rank + (c * linears[name].out_features if adaptation.dora else 0)
    return Terms(seq=seq, gathered=gathered, tp=tp)


def first_block_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """What the first block does not save when the embedding is frozen, beyond adapter_terms: its
    input needs no gradient, so its first norm keeps neither the input (RMSNorm: its fp32 copy) nor
    the statistics (RMSNorm's rsqrt; LayerNorm's mean and rstd), what needs a gradient starting at
    the adapters' outputs."""
    D = m.dim
    if m.family == "gpt2":
        return Terms(seq=d.stream * D + 2 * d.stream)
    return Terms(seq=FP32 * D + FP32)
