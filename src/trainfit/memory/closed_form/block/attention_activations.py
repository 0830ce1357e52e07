"""What a block's attention saves and makes in backward: the fused SDPA kernel's q, k, v, output and
logsumexp, torch's math kernel's fp32 copies and [heads, queries, keys] probabilities, context parallelism's
gathered keys and values, positions and masks. Apart from the rest of the block because its terms alone scale
with the sequence (per key) and depend on the kernel chosen. Torch-free."""

from __future__ import annotations

from trainfit.config import ModelConfig
from trainfit.memory.closed_form.block.activation_terms import (
    FP32,
    ActDtypes,
    Terms,
    block_shapes,
    layer_of,
    qk_norm_saved,
)
from trainfit.models.architecture import describe
from trainfit.sample_rows import FLEX_BLOCK


def attention_saved(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    D, q_dim, kv_dim, H, head_dim = block_shapes(m)
    c, a = d.compute, layer_of(m).attention
    # Under autocast RoPE casts its cos/sin tables to q's and k's bf16 (saved by its multiplies); after
    # QK-norm q and k are fp32 (the norm's fp32 gain promotes them), the tables' own dtype: no cast, unless
    # the norm casts back after its gain (Gemma's (1 + w)).
    cast_back = a.qk_norm is not None and a.qk_norm.offset
    per_position = 4 * head_dim * c if (d.autocast and a.rope and not d.packed_rows and (not a.qk_norm or cast_back)) \
        else 0
    qk_norm = qk_norm_saved(m, d)
    if d.eager_attention:
        return _eager_attention_saved(m, d) + Terms(per_position=per_position) + qk_norm
    if d.math_attention:
        return _math_attention_saved(m, d, cp) + Terms(per_position=per_position) + qk_norm
    # SDPA saves q (after RoPE), k (after RoPE), v, out, and an fp32 logsumexp per head.
    own = Terms(tp=c * (2 * q_dim + 2 * kv_dim) + FP32 * H, per_position=per_position)
    return own + qk_norm + _context_parallel_saved(m, d, cp)


def keys_per_query(cp: int) -> tuple[float, float]:
    """(keys each query attends, keys each SDPA call reads), per local token and in units of the
    local sequence: 1 and 1 on one rank (one [T, T] call). Under context parallelism a rank's two
    query chunks (local / 2 each) run one call each over the keys up to their chunk's end, chunks
    c + 1 and 2 cp - c: (2 cp + 1) chunks of keys in all (parallel/context_parallel.py)."""
    if cp == 1:
        return 1.0, 1.0
    return (2 * cp + 1) / 4, (2 * cp + 1) / 2


def _math_attention_saved(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    """torch 2.13's math SDPA (aten/src/ATen/native/transformers/attention.cpp,
    _scaled_dot_product_attention_math): 16-bit q, k, v are first copied to fp32 (unless
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True); off by default, CUDA and CPU alike);
    q and k are each multiplied by sqrt(scale) and k, v expanded to the query heads (a copy when
    G < H); scores = q k^T (bmm), + the causal mask, _safe_softmax, out = probs v (bmm), cast back.
    Saved for backward: the scaled q (by the first bmm), the scaled, expanded k (H heads), v (by the
    second bmm: the expanded fp32 copy under GQA; else its fp32 copy, or v itself when fp32) and the
    probabilities (softmax's output, fp32 [H, queries, keys]). Not the output nor a logsumexp: the
    output projection saves its own copy of the output (c x q_dim, the transposed bmm output made
    contiguous), as the fused kernel's `out` term counts it. Under context parallelism each query
    chunk's call reads its keys up to the chunk's end (keys_per_query): its k, v copies are that
    long; under fp32 without GQA v is a view of the gathered v, all of it kept."""
    D, q_dim, kv_dim, H, _ = block_shapes(m)
    gqa = m.num_kv_heads != m.num_heads
    per_query, per_call = keys_per_query(cp)
    v_view = not gqa and d.compute == FP32
    v = FP32 * (q_dim if gqa else kv_dim) * (cp if v_view else per_call)
    return Terms(tp=d.compute * q_dim + FP32 * (q_dim + q_dim * per_call) + v, per_key=FP32 * H * per_query)


def _eager_attention_saved(m: ModelConfig, d: ActDtypes) -> Terms:
    """models/eager_attention.py's form (Gemma 2's soft-capped scores where FlexAttention, which keeps what the
    fused kernel keeps, has no backward; gpt-oss's sinks on every device): the first matmul saves q and the keys
    expanded to the query heads (a copy under GQA), with a cap tanh its output ([heads, queries, keys] in the
    compute dtype), the fp32 softmax its output (with sinks over keys + 1: the sink's column too, the slice
    without it a view), the second matmul the probabilities cast back (unless fp32: the softmax's own) and the
    expanded values. No output nor logsumexp: the output projection saves its own copy of the output, as under
    the fused kernel."""
    D, q_dim, kv_dim, H, _ = block_shapes(m)
    c, a = d.compute, layer_of(m).attention
    expanded = q_dim if m.num_kv_heads != m.num_heads else kv_dim
    tanh, cast, sink = c if a.softcap else 0, c if c != FP32 else 0, FP32 * H if a.sinks else 0
    return Terms(tp=c * (2 * q_dim + 2 * expanded) + sink, per_key=H * (tanh + FP32 + cast))


def _context_parallel_saved(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    """What an attention saves under context parallelism beyond its unsharded form, per local token
    (parallel/context_parallel.py): its SDPAs save the all-gathered k and v of the whole sequence,
    cp times the rank's own (which nothing saves); each query chunk's output is its own SDPA's, so
    the output projection saves their merged copy too (unsharded, it saves a view of SDPA's)."""
    if cp == 1:
        return Terms()
    _, q_dim, kv_dim, _, _ = block_shapes(m)
    return Terms(tp=d.compute * (2 * kv_dim * (cp - 1) + q_dim))


def context_parallel_positions(m: ModelConfig, cp: int, table_bytes: int) -> Terms:
    """Llama under context parallelism: the RoPE tables' rows of the rank's positions, gathered once
    per forward (a copy; unsharded, a slice) and saved by every block's RoPE."""
    if cp == 1 or not layer_of(m).attention.rope:
        return Terms()
    return Terms(per_position=2 * block_shapes(m)[4] * table_bytes)


def packed_positions(m: ModelConfig, d: ActDtypes) -> Terms:
    """Packed rows (ActDtypes.packed_rows): each RoPE setting's cos and sin rows of every token's own position
    [B, 1, T, head_dim], in the queries' dtype, built once per forward and saved by every block's RoPE."""
    if not d.packed_rows:
        return Terms()
    a = layer_of(m).attention
    table = max(d.compute, d.stream) if a.qk_norm and not a.qk_norm.offset else d.compute  # models/llama.py
    return Terms(gathered=len(describe(m).rope_keys) * 2 * block_shapes(m)[4] * table)


def packed_mask_bytes(m: ModelConfig, rows: int, seq_len: int, compute: int, kernel: str) -> int:
    """Packed rows' document masks, one per distinct window of the layers, shared by its layers
    (models/document_attention.document_masks): SDPA's additive [B, 1, T, T] in the queries' dtype, or
    FlexAttention's block mask (int32 block counts [B, 1, n] and indices [B, 1, n, n], n = T / FLEX_BLOCK
    blocks, for the full and the partial blocks, by query and by key: four of each)."""
    windows = len({la.attention.window for la in describe(m).layers})
    if kernel == "sdpa":
        return windows * rows * seq_len * seq_len * compute
    n = -(-seq_len // FLEX_BLOCK)
    return windows * 4 * 4 * rows * (n * n + n)


def context_parallel_mask_bytes(local_len: int, cp: int, compute: int) -> int:
    """The additive causal masks of a rank's two query chunks, [chunk, end] each, in the queries'
    dtype, built once and shared by every layer: their ends sum to (2 cp + 1) chunks for every rank."""
    if cp == 1:
        return 0
    chunk = local_len // 2
    return (2 * cp + 1) * chunk * chunk * compute


def attention_backward(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    """The attention's backward at its peak, beyond what it saved. Fused: the gradients of q, k, v
    and out. Math: inside softmax's backward, the gradients of the probabilities (from the second
    bmm's backward) and of the scores (its output), both fp32 [H, queries, keys], while the fp32
    gradient of v (expanded under GQA) waits for its own path (its nodes were made earlier, so
    the engine runs them later)."""
    _, q_dim, kv_dim, H, _ = block_shapes(m)
    v = q_dim if m.num_kv_heads != m.num_heads else kv_dim
    if d.eager_attention:  # the fp32 softmax's backward (and the sink's column), the expanded v's gradient waiting
        sink = 2 * FP32 * H if layer_of(m).attention.sinks else 0
        return Terms(tp=d.compute * v + sink, per_key=2 * FP32 * H)
    if not d.math_attention:
        return Terms(tp=d.compute * (2 * q_dim + 2 * kv_dim))
    per_query, per_call = keys_per_query(cp)
    v = q_dim if m.num_kv_heads != m.num_heads else kv_dim
    return Terms(tp=FP32 * v * per_call, per_key=2 * FP32 * H * per_query)


def attention_kept(m: ModelConfig, d: ActDtypes, cp: int, policy: str) -> Terms:
    """What the selective policies keep of the attention itself (models/checkpoint_policy.py). The fused
    kernel: its output and fp32 logsumexp. The math kernel is two bmms among the block's matmuls:
    selective keeps both outputs, the fp32 scores [H, queries, keys] and the fp32 output, and
    recomputes the mask, the softmax and the casts; selective-alternate counts them as the 4th and
    5th matmuls (after wq, wk, wv), so it keeps the output only and the block's other matmuls keep
    their parity (the same projections are kept as with a fused kernel)."""
    _, q_dim, _, H, _ = block_shapes(m)
    if d.eager_attention:  # its two matmuls, in the compute dtype (as the math kernel's)
        scores = Terms(per_key=d.compute * H) if policy == "selective" else Terms()
        return Terms(tp=d.compute * q_dim) + scores
    if not d.math_attention:
        return Terms(tp=d.compute * q_dim + FP32 * H)
    scores = Terms(per_key=FP32 * H * keys_per_query(cp)[0]) if policy == "selective" else Terms()
    return Terms(tp=FP32 * q_dim) + scores
