"""The vocabulary of the activation estimate: bytes per token by how tensor parallelism divides them
(`Terms`), the dtypes they are saved in (`ActDtypes`), and the pieces every block shares (its shapes, a
pre-norm, a SwiGLU). The modules beside it count what autograd saves for backward in OUR blocks with these
(memory/closed_form/block/activations.py lists them). Torch-free.

Each figure below was read off the real modules (llama.TransformerBlock, moe.MoE, gpt2.Block)
by recording every tensor autograd packs (`torch.autograd.graph.saved_tensors_hooks`) and the
C-heap bytes each block adds, on CPU with torch 2.13; tests/estimator/ checks the sums against
measured training steps. Conventions:

- Bytes per token of one micro-batch, split by how tensor parallelism divides them:
  `seq` (residual-stream tensors: sharded along the sequence only with sequence parallelism),
  `gathered` (inputs of column-parallel and outputs of row-parallel matmuls: torch's DTensor
  sequence parallelism saves the all-gathered input of wq/wk/wv/w1/w3 and the full-sequence
  partial sum before the reduce-scatter, so tp never divides them; Megatron re-gathers in
  backward instead, which is why Korthikanti's TP+SP figure divides everything by t), and
  `tp` (head- and ffn-sharded tensors). Context parallelism divides the tokens.
- A block owns its input (the previous block's output, or the embedding output for block 0);
  the final norm owns the last block's output.
- Precision (`ActDtypes`): `stream` bytes of the residual stream, `compute` bytes of matmul
  outputs, `autocast` when torch.amp casts per op. Under autocast every matmul saves ITS OWN
  low-precision cast of an fp32 input (non-leaf casts are not cached: wq, wk and wv each keep
  one), norms, softmax and the residual stream stay fp32: that is why bf16-mixed does not halve
  activations. RMSNorm computes in fp32 (x.float()), so with a bf16 stream it saves an fp32 copy
  of its input (4 bytes) instead of the input itself.
- SDPA is the fused (flash / memory-efficient, CPU flash) kernel: it saves q, k, v, the output and
  an fp32 logsumexp of (batch, heads, seq): no seq^2 term. GQA keeps k, v at kv-head width.
  `ActDtypes.math_attention`: torch's math kernel instead (training.attention_backend=math), which
  saves fp32 copies and the [heads, seq, keys] fp32 probabilities (attention_activations.py).
- MoE routing (`Routing`, models/routing.py): dropless experts save one pass per routed token,
  k per token whatever the split between experts (exact in total); the split only decides how
  large ONE expert's computation is, which is what its backward's transient gradients scale with:
  sized for the busiest expert at memory.moe_imbalance. With a capacity factor every expert runs
  on a [capacity] buffer, so everything is sized by E x capacity rows, exactly.
- Expert parallelism (parallel/expert.py): a rank runs its experts on the rows it receives and
  gets back its own pairs (dropless: what each side saves is sized by its own count; the busiest
  rank receives routing.expert_parallel_loads' rows); capacity buffers keep their size.
- Not counted: autograd's own graph (nodes, saved-variable records), ~0.1-0.2 MiB in the C heap
  for the test models, negligible at scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.models.architecture import Layer, describe

FP32 = 4


INDEX = 8  # int64 (token ids, top-k expert ids, torch.nonzero results)


@dataclass(frozen=True)
class ActDtypes:
    stream: int
    """Bytes per element of the residual stream (block inputs/outputs, norm statistics' inputs)."""
    compute: int
    """Bytes per element of matmul and attention outputs."""
    autocast: bool
    """torch.amp: each matmul casts (and saves) its fp32 input itself."""
    math_attention: bool = False
    """SDPA runs torch's math kernel (run_shape.assumed_attention_kernel), not a fused one."""
    eager_attention: bool = False
    """Soft-capped scores (Gemma 2) run the eager attention, not FlexAttention (on the CPU:
    models/architecture.softcap_kernel), keeping its [heads, queries, keys] scores and probabilities."""
    packed_rows: bool = False
    """Packed fine-tuning samples (Layout.rows): the rows' RoPE tables are gathered per position and cast to
    the queries' dtype once per forward (models/llama.py), so no block casts (and saves) copies of its own."""
    dropout_noise: bool = False
    """Dropout saves a noise tensor in its input's dtype (torch's CPU dropout multiplies by one), not
    the bool mask of the fused native_dropout kernel (CUDA)."""

    def dropout_mask(self, input_bytes: int) -> int:
        """Bytes per element dropout saves for backward, of an input of `input_bytes` per element."""
        return input_bytes if self.dropout_noise else 1


class Terms(NamedTuple):
    """Saved bytes per token by tensor-parallel kind, plus bytes per sequence position."""

    seq: float = 0.0
    gathered: float = 0.0
    tp: float = 0.0
    per_position: float = 0.0
    """Bytes per position of the (local) sequence, independent of the batch (RoPE table casts)."""
    per_key: float = 0.0
    """Bytes per token and position of the local sequence, head-sharded like `tp`: the math attention
    kernel's [heads, queries, keys] scores and probabilities (keys per query: the local sequence,
    scaled under context parallelism by keys_per_query)."""

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.seq + other.seq, self.gathered + other.gathered, self.tp + other.tp,
                     self.per_position + other.per_position, self.per_key + other.per_key)

    def bytes(self, tokens: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False) -> int:
        """Total for `tokens` tokens (micro-batch x local sequence) of a local sequence `seq_len`."""
        seq = self.seq / tp if sequence_parallel else self.seq
        return int(tokens * (seq + self.gathered + self.tp / tp + seq_len * self.per_key / tp)
                   + seq_len * self.per_position)


def block_shapes(m: ModelConfig) -> tuple[int, int, int, int, int]:
    a = layer_of(m).attention
    return m.dim, a.q_dim, a.kv_dim, a.num_heads, a.head_dim


def layer_of(m: ModelConfig) -> Layer:
    """The block the estimate prices (models/architecture.py; every layer alike)."""
    return describe(m).block


def norm_saved(m: ModelConfig, d: ActDtypes, consumers: int) -> Terms:
    """A pre-norm (input owned by the caller) and what its consumers save of its output."""
    D = m.dim
    if layer_of(m).norm.kind == "layer":
        # native_layer_norm saves input (owned elsewhere), mean and rstd (stream dtype, 1 per token);
        # under autocast it runs in fp32 and its output is cast by each consumer.
        own = 2 * d.stream
    else:
        # RMSNorm: x.float() (the input itself, or its fp32 copy for a 16-bit stream: counted by
        # the caller as the residual), rsqrt (fp32, 1 per token), normed (cast back to the stream
        # dtype, saved by the gain's multiply; Gemma's (1 + w) multiplies it in fp32 and saves that).
        own = FP32 + normed_bytes(m, d.stream) * D
    out = consumers * d.compute * D if d.autocast else d.stream * D
    return Terms(seq=own, gathered=out)


def swiglu_saved(c: int, hidden: float) -> float:
    return 4 * c * hidden  # w1 out (silu input), w3 out, silu out, their product (w2 input)


def expert_glu_saved(m: ModelConfig, c: int) -> float:
    """What one routed expert row's hidden saves (models/moe.Glu): SwiGLU's four, or gpt-oss's clamped form's
    seven: the gate and up before their clamps (the clamps' inputs), the clamped gate and the sigmoid's output
    (their product's), up + 1 and that product (the next product's), and the hidden (w2's input)."""
    return (7 if m.swiglu_limit else 4) * c * m.expert_ffn_dim


def ffn_consumers(m: ModelConfig) -> int:
    mlp = layer_of(m).mlp
    if mlp and not mlp.gated:
        return 1
    if m.num_experts:
        return 1 + (2 if m.num_shared_experts else 0)  # router, shared w1 and w3
    return 2  # w1, w3


def norm_input_bytes(m: ModelConfig, d: ActDtypes) -> int:
    """Bytes per element a pre-norm saves of its input: LayerNorm the input itself, RMSNorm its fp32
    copy (x.float(); the input itself when the stream is fp32)."""
    return d.stream if layer_of(m).norm.kind == "layer" else FP32


def post_norms_saved(m: ModelConfig, d: ActDtypes) -> Terms:
    """A post-norm block's norms and the branches' inputs (models/architecture.py's norm_placement
    post, OLMo 2): each branch's first linears save the stream itself (the block input, the mid-block
    residual; under autocast each its own cast instead), and each norm after a branch saves the fp32
    copy of the branch's output, its rsqrt and the normed values in the output's dtype (the matmul's;
    an MoE's is the stream's)."""
    D, c = m.dim, d.compute
    ffn_out = d.stream if m.num_experts else c
    inputs = Terms(gathered=(3 + ffn_consumers(m)) * c * D if d.autocast else 2 * d.stream * D)
    return inputs + Terms(seq=2 * (FP32 * D + FP32) + (c + ffn_out) * D)


def scores_kept(m: ModelConfig, d: ActDtypes) -> bool:
    """Whether the attention keeps [heads, queries, keys] tensors for its backward, whose gradients come
    after the MLP's: torch's math SDPA kernel, or the eager soft-capped attention (Gemma 2's)."""
    return d.math_attention or d.eager_attention


def normed_bytes(m: ModelConfig, cast: int) -> int:
    """Bytes per element an RMSNorm's gain multiply saves of the normed values: cast back to `cast` (its
    input's dtype) first, as Llama's, or fp32 (Gemma's (1 + w), multiplied before the cast)."""
    return FP32 if layer_of(m).norm.gain_in_fp32 else cast


def sandwich_post_norms_saved(m: ModelConfig, d: ActDtypes) -> Terms:
    """The two norms after the branches of a sandwich block (Gemma): each saves the fp32 copy of the
    branch's output (the output itself in fp32), its rsqrt and the normed values (normed_bytes of the
    output's dtype: the matmul's; an MoE's is the stream's)."""
    D, c = m.dim, d.compute
    ffn_out = d.stream if m.num_experts else c
    return Terms(seq=2 * (FP32 * D + FP32) + (normed_bytes(m, c) + normed_bytes(m, ffn_out)) * D)


def ungated_mlp(m: ModelConfig) -> bool:
    """A dense MLP of two matmuls around its activation (GPT-2's fc, GELU, proj), not a SwiGLU."""
    mlp = layer_of(m).mlp
    return mlp is not None and not mlp.gated


def qk_norm_saved(m: ModelConfig, d: ActDtypes) -> Terms:
    """QK-norm (models/architecture.py): the RMSNorm of q and k (each head's, or each whole) saves its
    input's fp32 copy (the projection's output itself in fp32), its rsqrt per row and the normed values
    cast back to the projection's dtype (by the gain's multiply; Gemma's in fp32): head-sharded, like the
    projections."""
    a = layer_of(m).attention
    if not a.qk_norm:
        return Terms()
    return Terms(tp=(FP32 + normed_bytes(m, d.compute)) * (a.q_dim + a.kv_dim) + FP32 * a.qk_norm_rows())


@dataclass(frozen=True)
class Transient:
    """What one block's backward creates beyond its saved activations, by moment."""

    grad_stream: Terms
    """The incoming gradient of the residual stream."""
    grad_cast: Terms
    """Under autocast, its low-precision cast for the block's branch (once the branch's backward runs)."""
    branch_grad: Terms
    """The gradient of the MLP's output when its backward starts (and a checkpointed block's
    recompute with it): the stream's gradient's cast under autocast (an MoE's output is in the
    stream's dtype: none); with sequence parallelism, its all-gather over the sequence (the
    reduce-scatter's backward), which frees the local one. It is freed by the output matmul's
    backward, before the MLP's peak."""
    attention: Terms
    """The attention's gradients of q, k, v and out."""
    mlp_new: Terms
    """The MLP's intermediate gradients at their peak..."""
    mlp_freed: Terms
    """...when this saved forward tensor (activation, or recompute buffer) is already released."""
    recompute_tail: Terms
    """What a checkpointed block's recompute holds at its end beyond what it rebuilds. Dense: it
    stops when the MLP's output matmul saves its inputs (before its kernel runs), inside the MLP's
    forward, whose input (the norm's output, in the stream's dtype) is still referenced there; under
    sequence parallelism its all-gathered copy too (under autocast: otherwise the matmuls save
    them, and they are rebuilt). MoE: the same input, and as the block saves
    something after its output (the load-balancing loss), the recompute runs to the end: the routed
    output, the shared experts' output (unless the policy kept it) and their sum exist until it
    returns."""
    expert_output: Terms = Terms()
    """MoE, the largest routed computation (`Routing.busiest` rows): its backward starts with its
    rows of the layer's output gradient (index_select), their product with the routing weights (the
    gradient of the w2 output) and with the w2 output (for the routing weights' gradient), each in
    the dtype of the weighted output (the stream's: the fp32 routing weight promotes it under
    autocast)..."""
    expert_output_freed: Terms = Terms()
    """...when the weighted output, saved by index_add_, is freed (from then on)."""
    expert_hidden: Terms = Terms()
    """MoE: its SwiGLU's gradients (as mlp_new - mlp_freed for a dense MLP)."""
    expert_accumulation: Terms = Terms()
    """Dropless MoE: what the busiest expert holds while its slice gradients are summed into the
    stacked weights' (ROUTED_WEIGHT_GRAD_COPIES): the gradient of its w2 input."""
    expert_input_grad: Terms = Terms()
    """MoE: the layer input's gradient, summed over the shared experts', the routed experts' (each
    dropless expert's index_select backward a full-size scatter of its rows) and the router's."""
