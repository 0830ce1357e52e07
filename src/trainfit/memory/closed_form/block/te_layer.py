"""What a Megatron-Core transformer layer built of Transformer Engine modules keeps for its backward, and what
Megatron-Core's loss keeps: the saved activations of another engine's layer (perf/engines.Engine.layers
"transformer_engine"), for estimating runs made with it. trainfit's own blocks are block/activations.py's.
Torch-free.

Read off TE v2.5 (f05f12c97) and Megatron-Core core_v0.13.0 (c550cf6c41), the TE layer spec (norm fused into the
QKV and fc1 linears, TE's fused attention, row-parallel proj and fc2, Megatron's fused bias-SwiGLU, fused RoPE),
per token of one micro-batch, in bytes; under sequence parallelism every term is the sequence shard's (TE's
LayerNormLinear saves its local norm output and gathers it again in backward), else the norms' terms are whole:

| saved                                   | bf16               | fp8 (delayed or current scaling)  |
| --------------------------------------- | ------------------ | --------------------------------- |
| each norm's input (the residual)        | 2h                 | 2h                                |
| each norm's output (its linear's input) | 2h                 | h (one fp8 copy)                  |
| each norm's statistics (fp32)           | 4, LayerNorm 8     | the same                          |
| q, k (after RoPE), v, attention output  | 2(q + 2kv) + 2q    | the same                          |
| softmax statistics (fp32 per head)      | 4 heads            | the same                          |
| proj input (the attention output)       | shared             | + q (its fp8 copy)                |
| fc1 output (the activation's input)     | 2 x (2f or f)      | the same                          |
| fc2 input (the activation's output)     | 2f                 | f (fp8; the bf16 one freed)       |

Korthikanti et al. (arXiv 2205.05198, Table 2: 34 sbh / t with sequence parallelism) is this count for a GPT
layer with two 1-byte dropout masks; flash attention removes its 5 a s^2 b term. Under context parallelism TE's
ring attention keeps one received KV chunk in place of the local k and v: the same bytes at s / cp tokens.

The loss (megatron/core/tensor_parallel/cross_entropy.py): an fp32 copy of the vocabulary shard's logits, made
the softmax in place, a bool mask and an int64 target per token; the bf16 logits are freed when the model's
forward returns."""

from __future__ import annotations

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import FP32, INDEX, Terms, layer_of

FP8 = 1


def te_layer_terms(m: ModelConfig, fp8: bool) -> Terms | None:
    """One layer's saved bytes per token (module docstring's table), or None where the table does not
    describe the layer (MoE, post or sandwich norms, QK-norm, soft-capped scores): estimate those as
    trainfit's."""
    layer = layer_of(m)
    mlp, a = layer.mlp, layer.attention
    if mlp is None or layer.norm_placement != "pre" or a.qk_norm or a.softcap:
        return None
    D, q, kv, f = m.dim, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, mlp.hidden
    linear_input = FP8 if fp8 else 2
    stats = FP32 * (2 if layer.norm.kind == "layer" else 1)
    norms = 2 * (2 * D + linear_input * D + stats)
    attention = 2 * (q + 2 * kv) + 2 * q + FP32 * a.num_heads + (FP8 * q if fp8 else 0)
    mlp_saved = 2 * (2 * f if mlp.gated else f) + linear_input * f
    # the residual stream's terms follow sequence parallelism; the rest is split by tp
    return Terms(seq=norms, tp=attention + mlp_saved)


def megatron_loss_saved(vocab_shard: int) -> int:
    """Bytes per token Megatron-Core's cross entropy keeps for its backward (module docstring)."""
    return FP32 * vocab_shard + 1 + INDEX
