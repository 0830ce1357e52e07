"""Activation memory in closed form: what autograd saves for backward in OUR blocks. Torch-free.

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
  saves fp32 copies and the [heads, seq, keys] fp32 probabilities (`_math_attention_saved`).
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

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from trainfit.config import ModelConfig
from trainfit.models.block_spec import odd_expert_share, shared_experts_first_matmul
from trainfit.models.routing import dropless_loads, expert_capacity, expert_parallel_loads

FP32 = 4
INDEX = 8  # int64 (token ids, top-k expert ids, torch.nonzero results)
# torch.nonzero(as_tuple=True) returns views of one (M, 2) int64 result, which both the
# index_select and the gather of routing weights save: 16 bytes per routed token.
ROUTED_INDEX_BYTES = 2 * INDEX
# Dropless expert parallelism: per received row the expert-major order and its inverse (int64,
# each saved by an index_select); per own pair its token and its place in the expert order.
EP_RECEIVED_INDEX_BYTES = EP_PAIR_INDEX_BYTES = 2 * INDEX
ROUTED_WEIGHT_GRAD_COPIES = (3, 5)
"""Dropless MoE backward, in stacked expert weights ([E, F, D] each): moe.GroupedExperts uses
expert e's slice `w1[e]`, whose backward (select_backward) returns a zero-filled full-size gradient
of the stacked weight; autograd sums those across the experts out of place. From the first expert's
backward to the layer's last, the running sums of w1, w2 and w3 exist (3); while an expert's slice
gradient is added to one of them, the new full-size slice and the new sum too (5). Read off the
torch 2.13 autograd graph (SelectBackward0, InputBuffer::accumulate) and measured on CPU."""


@dataclass(frozen=True)
class Routing:
    """How many rows a micro-batch's routed experts process, per token of the micro-batch."""

    rows: float
    """Expert rows in all: top_k (dropless: each token's k passes) or E x capacity / tokens (the
    capacity buffers, padding included)."""
    busiest: float
    """Rows of the largest single expert computation: dropless, the busiest expert's (the experts
    run one after the other); capacity, all E x capacity (one batched matmul for all experts)."""
    capacity: bool
    tail: float = 0.0
    """Dropless: rows of each of the two experts whose backward runs first (the last two; as light
    as the imbalance allows, routing.dropless_loads), whose saved tensors are freed by then."""
    pairs: float = 0.0
    """Dropless expert parallelism: the rank's own (token, choice) pairs (top_k), which its experts'
    outputs come back as; `rows` are then the rows its experts receive. 0 without it."""
    ep: int = 1
    """Expert-parallel degree: the rank runs num_experts / ep experts, between two all-to-alls."""

    @property
    def returned(self) -> float:
        """Rows per token the combine all-to-all brings back: the pairs (dropless), the slots (capacity)."""
        return self.pairs or self.rows

    def local_experts(self, num_experts: int) -> int:
        return num_experts // self.ep


def moe_routing(m: ModelConfig, num_tokens: int, imbalance: float, ep: int = 1) -> Routing | None:
    """The routing of one MoE layer on `num_tokens` tokens (a rank's micro-batch), None for dense
    models; `imbalance` is memory.moe_imbalance (dropless only); `ep` the expert-parallel degree
    (capacity: a rank's experts take ep sources' buffers of their capacity, E x capacity rows in
    all; dropless: the busiest rank's)."""
    if not m.num_experts:
        return None
    E, k = m.num_experts, m.experts_per_token
    if m.capacity_factor:
        rows = E * expert_capacity(num_tokens, k, E, m.capacity_factor) / num_tokens
        return Routing(rows=rows, busiest=rows, capacity=True, ep=ep)
    if ep > 1:
        loads = expert_parallel_loads(num_tokens, k, E, ep, imbalance)
        return Routing(rows=sum(loads) / num_tokens, busiest=max(loads) / num_tokens, capacity=False,
                       tail=loads[-1] / num_tokens, pairs=k, ep=ep)
    loads = dropless_loads(num_tokens, k, E, imbalance)
    return Routing(rows=k, busiest=max(loads) / num_tokens, capacity=False, tail=loads[-1] / num_tokens)


def _balanced(m: ModelConfig) -> Routing:
    """Dropless and perfectly balanced: what the functions below assume when given no routing."""
    return Routing(rows=m.experts_per_token, busiest=m.experts_per_token / m.num_experts, capacity=False)


@dataclass(frozen=True)
class ActDtypes:
    stream: int
    """Bytes per element of the residual stream (block inputs/outputs, norm statistics' inputs)."""
    compute: int
    """Bytes per element of matmul and attention outputs."""
    autocast: bool
    """torch.amp: each matmul casts (and saves) its fp32 input itself."""
    math_attention: bool = False
    """SDPA runs torch's math kernel (analytic.assumed_attention_kernel), not a fused one."""


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
    scaled under context parallelism by _keys_per_query)."""

    def __add__(self, other: Terms) -> Terms:
        return Terms(self.seq + other.seq, self.gathered + other.gathered, self.tp + other.tp,
                     self.per_position + other.per_position, self.per_key + other.per_key)

    def bytes(self, tokens: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False) -> int:
        """Total for `tokens` tokens (micro-batch x local sequence) of a local sequence `seq_len`."""
        seq = self.seq / tp if sequence_parallel else self.seq
        return int(tokens * (seq + self.gathered + self.tp / tp + seq_len * self.per_key / tp)
                   + seq_len * self.per_position)


def _shapes(m: ModelConfig) -> tuple[int, int, int, int, int]:
    head_dim = m.dim // m.num_heads
    return m.dim, m.num_heads * head_dim, m.num_kv_heads * head_dim, m.num_heads, head_dim


def _norm(m: ModelConfig, d: ActDtypes, consumers: int) -> Terms:
    """A pre-norm (input owned by the caller) and what its consumers save of its output."""
    D = m.dim
    if m.family == "gpt2":
        # native_layer_norm saves input (owned elsewhere), mean and rstd (stream dtype, 1 per token);
        # under autocast it runs in fp32 and its output is cast by each consumer.
        own = 2 * d.stream
    else:
        # RMSNorm: x.float() (the input itself, or its fp32 copy for a 16-bit stream: counted by
        # the caller as the residual), rsqrt (fp32, 1 per token), normed (cast back to the stream
        # dtype, saved by the gain's multiply).
        own = FP32 + d.stream * D
    out = consumers * d.compute * D if d.autocast else d.stream * D
    return Terms(seq=own, gathered=out)


def _attention_saved(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    D, q_dim, kv_dim, H, head_dim = _shapes(m)
    c = d.compute
    per_position = 4 * head_dim * c if (d.autocast and m.family == "llama") else 0  # cos/sin .to(bf16), q and k
    if d.math_attention:
        return _math_attention_saved(m, d, cp) + Terms(per_position=per_position)
    # SDPA saves q (after RoPE), k (after RoPE), v, out, and an fp32 logsumexp per head.
    own = Terms(tp=c * (2 * q_dim + 2 * kv_dim) + FP32 * H, per_position=per_position)
    return own + _context_parallel_saved(m, d, cp)


def _keys_per_query(cp: int) -> tuple[float, float]:
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
    chunk's call reads its keys up to the chunk's end (_keys_per_query): its k, v copies are that
    long; under fp32 without GQA v is a view of the gathered v, all of it kept."""
    D, q_dim, kv_dim, H, _ = _shapes(m)
    gqa = m.num_kv_heads != m.num_heads
    per_query, per_call = _keys_per_query(cp)
    v_view = not gqa and d.compute == FP32
    v = FP32 * (q_dim if gqa else kv_dim) * (cp if v_view else per_call)
    return Terms(tp=d.compute * q_dim + FP32 * (q_dim + q_dim * per_call) + v, per_key=FP32 * H * per_query)


def _context_parallel_saved(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    """What an attention saves under context parallelism beyond its unsharded form, per local token
    (parallel/context_parallel.py): its SDPAs save the all-gathered k and v of the whole sequence,
    cp times the rank's own (which nothing saves); each query chunk's output is its own SDPA's, so
    the output projection saves their merged copy too (unsharded, it saves a view of SDPA's)."""
    if cp == 1:
        return Terms()
    _, q_dim, kv_dim, _, _ = _shapes(m)
    return Terms(tp=d.compute * (2 * kv_dim * (cp - 1) + q_dim))


def context_parallel_positions(m: ModelConfig, cp: int, table_bytes: int) -> Terms:
    """Llama under context parallelism: the RoPE tables' rows of the rank's positions, gathered once
    per forward (a copy; unsharded, a slice) and saved by every block's RoPE."""
    if cp == 1 or m.family != "llama":
        return Terms()
    return Terms(per_position=2 * (m.dim // m.num_heads) * table_bytes)


def context_parallel_mask_bytes(local_len: int, cp: int, compute: int) -> int:
    """The additive causal masks of a rank's two query chunks, [chunk, end] each, in the queries'
    dtype, built once and shared by every layer: their ends sum to (2 cp + 1) chunks for every rank."""
    if cp == 1:
        return 0
    chunk = local_len // 2
    return (2 * cp + 1) * chunk * chunk * compute


def _swiglu_saved(c: int, hidden: float) -> float:
    return 4 * c * hidden  # w1 out (silu input), w3 out, silu out, their product (w2 input)


def _moe_saved(m: ModelConfig, d: ActDtypes, r: Routing) -> Terms:
    """Router, top-k, the routed experts' rows (moe.GroupedExperts) and the shared experts."""
    E, k = m.num_experts, m.experts_per_token
    router = FP32 * E + INDEX * k + FP32 * k + FP32  # softmax probs, top-k ids, top-k weights and their sum
    # Per expert row: the expert's input (index_select; under autocast w1 and w3 (bmm) each save a
    # cast), 4 SwiGLU tensors, the routing weight, the w2 output and the weighted output y
    # (index_add_ saves it), plus its token index: dropless, the (M, 2) nonzero() result;
    # capacity, the slot's token (int64), and per (token, choice) pair the slot index that the
    # routing weights' scatter saves.
    per_row = _routed_row_saved(m, d)
    if r.capacity:
        routed = r.rows * (INDEX + per_row) + k * INDEX
    elif r.pairs:  # expert parallelism: the experts' side per received row, the combine's per own pair
        routed = r.rows * (EP_RECEIVED_INDEX_BYTES + _expert_row_saved(m, d)) + \
            r.pairs * (EP_PAIR_INDEX_BYTES + _combine_row_saved(m, d))
    else:
        routed = r.rows * (ROUTED_INDEX_BYTES + per_row)
    shared = _swiglu_saved(d.compute, m.num_shared_experts * m.expert_ffn_dim)
    return Terms(gathered=router + routed + shared)  # whole sequence, whole experts on every tp rank


def _routed_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """What one expert row saves, its token index aside (see _moe_saved)."""
    return _expert_row_saved(m, d) + _combine_row_saved(m, d)


def _expert_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """The expert's side of a row: its input (or autocast's two casts of it) and the SwiGLU's four."""
    x_in = 2 * d.compute * m.dim if d.autocast else d.stream * m.dim
    return x_in + _swiglu_saved(d.compute, m.expert_ffn_dim)


def _combine_row_saved(m: ModelConfig, d: ActDtypes) -> float:
    """The combine's side of a row: its routing weight, the w2 output and the weighted output."""
    return d.stream + d.compute * m.dim + d.stream * m.dim


def _ffn_consumers(m: ModelConfig) -> int:
    if m.family == "gpt2":
        return 1
    if m.num_experts:
        return 1 + (2 if m.num_shared_experts else 0)  # router, shared w1 and w3
    return 2  # w1, w3


def block_terms(m: ModelConfig, d: ActDtypes, policy: str, routing: Routing | None = None, cp: int = 1,
                tp: int = 1) -> Terms:
    """What one block keeps from its forward to its backward, input included (MoE: `routing`, by
    default dropless and balanced; `cp`, `tp`: context- and tensor-parallel degrees)."""
    D, q_dim, kv_dim, H, _ = _shapes(m)
    c, a = d.compute, d.stream
    if policy == "full":
        return Terms(seq=a * D)  # the checkpoint keeps the block input only
    if policy == "selective":
        # recompute._SAVE_OPS: the outputs of every matmul and of the fused attention are stored,
        # the rest (norms, RoPE, activations, casts) is recomputed; plus the block input.
        kept = Terms(seq=a * D, tp=c * (q_dim + 2 * kv_dim)) + _attention_kept(m, d, cp, policy)  # wq, wk, wv
        kept += Terms(gathered=c * D)  # wo output (under TP: the partial sum before the reduce-scatter)
        kept += _row_parallel_reductions(m, d, tp)
        if m.family == "gpt2":
            return kept + Terms(gathered=c * D, tp=c * m.ffn_dim)  # fc2 output; fc1 output
        if not m.num_experts:
            return kept + Terms(gathered=c * D, tp=2 * c * m.ffn_dim)  # w2 output; w1, w3 outputs
        E, F, rows = m.num_experts, m.expert_ffn_dim, (routing or _balanced(m)).rows
        shared = m.num_shared_experts * F
        kept += Terms(gathered=c * E + rows * c * (2 * F + D))  # router logits; each expert row: w1, w3, w2 outputs
        kept += _all_to_all_outputs(m, d, routing or _balanced(m))
        return kept + Terms(gathered=(c * D if shared else 0) + 2 * c * shared)  # shared w2; shared w1, w3
    if policy == "selective-alternate":
        return _alternate_kept(m, d, routing, tp, cp)
    if policy != "none":
        raise ValueError(f"activation checkpointing policy {policy!r}: choose none, selective, "
                         "selective-alternate or full")
    # Block input (for RMSNorm with a 16-bit stream, its fp32 copy replaces it: see _norm) and
    # the mid-block residual h, each saved at 4 bytes by the norm that reads it (RMSNorm) or at
    # stream bytes (LayerNorm saves its input as is).
    residual = 2 * (a * D if m.family == "gpt2" else FP32 * D)
    terms = Terms(seq=residual) + _norm(m, d, 3) + _attention_saved(m, d, cp) + _norm(m, d, _ffn_consumers(m))
    if m.family == "gpt2":
        return terms + Terms(tp=2 * c * m.ffn_dim)  # fc1 out (GELU input), GELU out (fc2 input)
    if m.num_experts:
        return terms + _moe_saved(m, d, routing or _balanced(m))
    return terms + Terms(tp=_swiglu_saved(c, m.ffn_dim))


@dataclass(frozen=True)
class PolicyOnly:
    """What a checkpointing policy saves that an unwrapped block does not (see policy_only_terms)."""

    released: Terms
    """Consumed by the block's recompute in backward, which frees them from the policy's cache."""
    kept: Terms
    """Alive until the block's backward ends."""
    released_last: Terms = Terms()
    """The part of `released` the recompute's last operator consumes, alive at its end: an MoE
    block's shared experts' w2 output (their sum with the routed output)."""


def _row_parallel_reductions(m: ModelConfig, d: ActDtypes, tp: int) -> Terms:
    """Tensor parallelism under the selective policies (recompute._SAVE_OPS): the reduced outputs of
    the row-parallel projections (wo; w2 / fc2 unless the feed-forward is an MoE, whole on the tp
    ranks), the reduce-scatter's sequence shard with sequence parallelism, the all-reduce's whole
    tensor without: the residual stream's shape (`seq`)."""
    return _reduction(m, d, tp) + (Terms() if m.num_experts else _reduction(m, d, tp))


def _reduction(m: ModelConfig, d: ActDtypes, tp: int) -> Terms:
    """One row-parallel projection's reduced output (see _row_parallel_reductions)."""
    return Terms(seq=d.compute * m.dim) if tp > 1 else Terms()


def _policy_keeps_shared_output(m: ModelConfig, r: Routing, policy: str) -> bool:
    """Whether a checkpointing policy saves the shared experts' w2 output (selective: every matmul's;
    selective-alternate: when w2 is an odd-numbered matmul)."""
    if policy == "selective-alternate":
        return shared_experts_first_matmul(r.local_experts(m.num_experts), r.capacity) % 2 == 1
    return policy == "selective"


def _all_to_all_outputs(m: ModelConfig, d: ActDtypes, r: Routing) -> Terms:
    """Expert parallelism under the selective policies (recompute._SAVE_OPS keeps collectives): the
    dispatch all-to-all's output (the rows received) and the combine's (the rows returned)."""
    return Terms(gathered=(r.rows + r.returned) * d.compute * m.dim if r.ep > 1 else 0)


def _attention_kept(m: ModelConfig, d: ActDtypes, cp: int, policy: str) -> Terms:
    """What the selective policies keep of the attention itself (recompute._SAVE_OPS). The fused
    kernel: its output and fp32 logsumexp. The math kernel is two bmms among the block's matmuls:
    selective keeps both outputs, the fp32 scores [H, queries, keys] and the fp32 output, and
    recomputes the mask, the softmax and the casts; selective-alternate counts them as the 4th and
    5th matmuls (after wq, wk, wv), so it keeps the output only and the block's other matmuls keep
    their parity (the same projections are kept as with a fused kernel)."""
    _, q_dim, _, H, _ = _shapes(m)
    if not d.math_attention:
        return Terms(tp=d.compute * q_dim + FP32 * H)
    scores = Terms(per_key=FP32 * H * _keys_per_query(cp)[0]) if policy == "selective" else Terms()
    return Terms(tp=FP32 * q_dim) + scores


def _alternate_kept(m: ModelConfig, d: ActDtypes, routing: Routing | None, tp: int, cp: int = 1) -> Terms:
    """`selective-alternate` (recompute._alternate_contexts): the block input, the outputs of the
    fused attention, of tp's reductions and of the odd-numbered matmuls in forward order: wq (1st)
    and wv (3rd), not wk or wo; Llama's w1 (5th) and w2 (7th), not w3; GPT-2's fc1 (5th), not fc2.
    MoE: the router (5th); dropless expert e runs matmuls 6 + 3e to 8 + 3e, so even-numbered experts
    keep w3, odd-numbered ones w1 and w2 (counted as if the rows split between them as the experts
    do); with a capacity factor the batched w3 (7th); the shared experts by their position."""
    D, q_dim, kv_dim, H, _ = _shapes(m)
    c = d.compute
    kept = Terms(seq=d.stream * D, tp=c * (q_dim + kv_dim)) + _attention_kept(m, d, cp, "selective-alternate")  # wq, wv
    kept += _row_parallel_reductions(m, d, tp)
    if m.family == "gpt2":
        return kept + Terms(tp=c * m.ffn_dim)
    if not m.num_experts:
        return kept + Terms(tp=c * m.ffn_dim, gathered=c * D)
    F, r = m.expert_ffn_dim, routing or _balanced(m)
    if r.capacity:
        routed = r.rows * c * F
    else:
        odd = odd_expert_share(r.local_experts(m.num_experts))  # (and, balanced, of their rows) keep w1 and w2
        routed = r.rows * c * ((1 - odd) * F + odd * (F + D))
    shared = m.num_shared_experts * F
    shared_kept = c * (shared + D) if _policy_keeps_shared_output(m, r, "selective-alternate") else c * shared
    return kept + _all_to_all_outputs(m, d, r) + Terms(gathered=c * m.num_experts + routed +
                                                      (shared_kept if shared else 0))


def policy_only_terms(m: ModelConfig, d: ActDtypes, policy: str, tp: int = 1,
                      routing: Routing | None = None, cp: int = 1) -> PolicyOnly:
    """Tensors a checkpointed block keeps that the unwrapped block does not save, so that its
    recompute rebuilds (unwrapped - policy) + released + kept:
    - the block input in a 16-bit stream, for Llama: unwrapped, RMSNorm saves only its fp32 copy;
    - selective: matmul outputs whose consumers keep nothing of them: wo's and w2's (fc2's) feed
      residual adds; Llama's wq and wk outputs feed RoPE, whose outputs are what SDPA saves; an
      MoE router's logits feed a softmax, which saves its output; tp's reduced outputs of wo and
      w2 (fc2) feed residual adds. The recompute consumes all but the last matmul's (w2 / fc2)
      and its reduction, where it stops; an MoE block's it consumes all (it runs to the end).
    - selective-alternate: the same among what it keeps: Llama's wq (not wk), w2 and the
      reductions; GPT-2's reductions; an MoE's router and, when kept, its shared experts' w2.
    - the math attention kernel's kept bmm outputs (_attention_kept): the unwrapped block saves
      neither (softmax's output and the output projection's contiguous copy instead); the
      recompute consumes both."""
    D, q_dim, kv_dim, _, _ = _shapes(m)
    c = d.compute
    block_input = Terms(seq=d.stream * D if m.family == "llama" and d.stream != FP32 else 0)
    if policy not in ("selective", "selective-alternate"):
        return PolicyOnly(Terms(), block_input)
    alternate = policy == "selective-alternate"
    released = _reduction(m, d, tp) + Terms(gathered=0 if alternate else c * D)  # wo's reduction, output
    if d.math_attention:
        released += _attention_kept(m, d, cp, policy)
    if m.family == "llama":
        released += Terms(tp=c * (q_dim + (0 if alternate else kv_dim)))  # wq, wk outputs (before RoPE)
    if m.num_experts:
        # The recompute runs to the block's end (the load-balancing loss is saved after the output):
        # it consumes the router's logits and, when kept, the shared experts' w2 output.
        r = routing or _balanced(m)
        shared_w2 = m.num_shared_experts and _policy_keeps_shared_output(m, r, policy)
        last = Terms(gathered=c * D if shared_w2 else 0)
        return PolicyOnly(released + Terms(gathered=c * m.num_experts) + _expert_parallel_released(m, d, r, policy)
                          + last, block_input, last)
    last = _reduction(m, d, tp)  # w2's / fc2's reduction, and w2's (fc2's) output unless recomputed
    if not (alternate and m.family == "gpt2"):
        last += Terms(gathered=c * D)
    return PolicyOnly(released, block_input + last)


def _expert_parallel_released(m: ModelConfig, d: ActDtypes, r: Routing, policy: str) -> Terms:
    """Expert parallelism under the selective policies: kept tensors the unwrapped block does not save,
    so its recompute consumes them: the dispatch all-to-all's output (reordered by expert, or by
    expert and source) and the experts' w2 outputs the policy keeps (concatenated, or reordered by
    source, into the combine's input; on one rank the routing weights' product saves them)."""
    if r.ep == 1:
        return Terms()
    w2_kept = 1.0 if policy == "selective" else 0.0 if r.capacity else odd_expert_share(r.local_experts(m.num_experts))
    return Terms(gathered=r.rows * d.compute * m.dim * (1 + w2_kept))


def shared_experts_saved(m: ModelConfig, d: ActDtypes, policy: str) -> tuple[Terms, Terms]:
    """(kept by the policy, rebuilt by the recompute) of what the shared experts save: their
    backward runs before the routed experts' (their sum is the layer's last op), so by the routed
    experts' backward these are freed. The SwiGLU's 4 tensors (selective keeps the matmul outputs,
    w1 and w3, and recomputes silu and the product; selective-alternate keeps one of w1 and w3;
    full recomputes all four) and under autocast the casts of their input that w1 and w3 save
    (recomputed by every policy)."""
    if not m.num_shared_experts:
        return Terms(), Terms()
    saved = _swiglu_saved(d.compute, m.num_shared_experts * m.expert_ffn_dim)
    casts = 2 * d.compute * m.dim if d.autocast else 0
    kept = {"none": saved, "selective": saved / 2, "selective-alternate": saved / 4}.get(policy, 0.0)
    return Terms(gathered=kept + (casts if policy == "none" else 0)), \
        Terms(gathered=saved - kept + (0 if policy == "none" else casts))


@dataclass(frozen=True)
class RoutedMoment:
    """One moment of an MoE layer's routed-expert backward, in bytes (elements for `done`)."""

    done: int
    """Gradient elements complete: the shared experts' weights (their backward ran first), with a
    capacity factor also the stacked w2 (one batched matmul)."""
    added: int
    """Added to the activations: the experts' gradients and autograd's running sums."""
    freed: int
    """Saved bytes of the layer already freed (the weighted output, index_add_'s): from the
    activations, or from the recompute of a checkpointed block."""
    uncast: int
    """16-bit weight casts already freed (autocast: each dropless expert frees its slices' own)."""
    freed_kept: int = 0
    """The part of `freed` that a checkpointed block's policy kept (not rebuilt by its recompute):
    expert parallelism's returned rows under the selective policies."""


def routed_backward_moments(m: ModelConfig, d: ActDtypes, t: Transient, routing: Routing,
                            size: Callable[[Terms], int], *, expert_weight: int, grad_bytes: int,
                            num_local_experts: int, policy: str = "none") -> list[RoutedMoment]:
    """The candidate peaks of the routed experts' backward (the shared experts' saved tensors are
    freed by then: shared_experts_saved). `expert_weight`: elements of one stacked expert weight
    on the rank; `grad_bytes`: bytes per element of the gradients the experts' slices produce (the
    sliced weights' dtype: fp32 masters under autocast, the unsharded compute copies under FSDP).

    Capacity: the output-gradient moment, then the SwiGLU gradients with w2's gradient done.
    Dropless (ROUTED_WEIGHT_GRAD_COPIES): from the second expert backward on the three running sums
    and the layer input's gradient sum exist; then either an expert with no tokens summing its
    full-size slice gradients and input-gradient scatter (nothing of its own freed), or the busiest
    expert's own moments (routing.dropless_loads places it third from last, after two light ones:
    one and two experts' saved tensors and casts freed; `Routing.tail`)."""
    shared = 3 * m.num_shared_experts * m.expert_ffn_dim * m.dim  # whole on the tp ranks
    shared_casts = d.compute * shared if d.autocast else 0  # freed with the shared experts' backward
    output, hidden, freed = size(t.expert_output), size(t.expert_hidden), size(t.expert_output_freed)
    if routing.capacity:
        # The shared experts' input gradient waits for the routed experts' (one sum, from then on).
        pending = size(t.expert_input_grad) if m.num_shared_experts else 0
        return [RoutedMoment(shared, pending + output, freed, shared_casts),
                RoutedMoment(shared + expert_weight, pending + hidden, freed, shared_casts)]
    unit = expert_weight * grad_bytes
    if routing.pairs:
        return _expert_parallel_moments(m, d, t, routing, size, shared=shared, shared_casts=shared_casts,
                                        expert_weight=expert_weight, unit=unit, policy=policy)
    copies, summing = ROUTED_WEIGHT_GRAD_COPIES
    input_grad = size(t.expert_input_grad)
    running, adding = copies * unit + input_grad, (summing - copies) * unit
    cast_expert = d.compute * 3 * expert_weight // max(1, num_local_experts) if d.autocast else 0
    busiest = max(output, hidden, adding + size(t.expert_accumulation))
    light = size(Terms(gathered=routing.tail * (ROUTED_INDEX_BYTES + _routed_row_saved(m, d))))  # one light expert's
    return [RoutedMoment(shared, running + adding, light, shared_casts + cast_expert),
            RoutedMoment(shared, running + 2 * input_grad, 2 * light, shared_casts + 2 * cast_expert),
            RoutedMoment(shared, running + busiest, freed + 2 * light, shared_casts + 2 * cast_expert)]


def _expert_parallel_moments(m: ModelConfig, d: ActDtypes, t: Transient, routing: Routing,
                             size: Callable[[Terms], int], *, shared: int, shared_casts: int, expert_weight: int,
                             unit: int, policy: str) -> list[RoutedMoment]:
    """Dropless expert parallelism's routed backward (parallel/expert.py, in reverse): the combine's
    product with the routing weights (3 x the rank's pairs; the weighted output freed), its
    all-to-all (pairs + the rows received; the returned outputs freed), the return to expert order
    (2 x received); the experts one at a time under their output gradients (received), the busiest
    first at worst, before any other's is summed; then, every expert's weights done and saved rows
    freed, their input gradients concatenated and put back in received order (2 x received), before
    the dispatch's all-to-all (received + pairs). The shared experts' input gradient, if any, waits.
    The selective policies keep the returned rows (collectives' outputs), so a checkpointed block
    frees those from what it kept, not from its recompute."""
    D, s = m.dim, d.stream
    pairs, received = (size(Terms(gathered=rows * s * D)) for rows in (routing.pairs, routing.rows))
    pending = size(t.expert_input_grad) if m.num_shared_experts else 0
    copies, summing = ROUTED_WEIGHT_GRAD_COPIES
    busiest = max(size(t.expert_hidden), (summing - copies) * unit + size(t.expert_accumulation))
    experts_saved = size(Terms(gathered=routing.rows * (EP_RECEIVED_INDEX_BYTES + _expert_row_saved(m, d))))

    kept = pairs if policy in ("selective", "selective-alternate") else 0

    def at(added: int, freed: int, done: int = 0) -> RoutedMoment:
        return RoutedMoment(shared + done, pending + added, freed, shared_casts, min(freed - pairs, kept))

    return [at(3 * pairs, pairs), at(pairs + received, 2 * pairs), at(2 * received, 2 * pairs),
            at(received + copies * unit + busiest, 2 * pairs),
            at(2 * received, 2 * pairs + experts_saved, done=3 * expert_weight),
            at(received + pairs, 2 * pairs + experts_saved, done=3 * expert_weight)]


def final_norm_terms(m: ModelConfig, d: ActDtypes, projected: bool = True) -> Terms:
    """The final norm: its input (the last block's output) and what the output projection saves of
    its output. `projected` False: the chunked loss projects it (train/loss.py), and its output is
    the model's, which the loss holds (analytic._chunked_loss: logits)."""
    residual = d.stream * m.dim if m.family == "gpt2" else FP32 * m.dim
    norm = _norm(m, d, 1)
    return Terms(seq=residual) + (norm if projected else Terms(seq=norm.seq))


def stage_boundary_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """One micro-batch of the residual stream where a pipeline stage ends and the next begins: the
    stage's output, the next stage's input, and their gradients ([mb, T, D] in the stream's dtype;
    sequence-sharded under sequence parallelism, like the stream itself)."""
    return Terms(seq=d.stream * m.dim)


def weight_pass_pending_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """What a zero-bubble schedule's input-gradient pass keeps per block for the weight pass, beside
    the saved activations (torch/distributed/pipelining/_backward.py, stage_backward_input): a
    pre-hook on every node where a weight meets the input path (the matmuls' MmBackward0, the
    norms' MulBackward0 by their gain) stores its output's gradient in `param_group["grads"]`
    until stage_backward_weight. Per token: the gradient of each matmul's output (compute dtype;
    column-parallel ones on a tp rank: their 1/tp), of each norm's output and of the two residual
    sums the block's output matmuls feed (stream dtype). MoE: each of the token's routed and shared
    experts' two input matmuls and the router's logits instead of the dense MLP's."""
    D, q_dim, kv_dim, _, _ = _shapes(m)
    c, a = d.compute, d.stream
    if m.num_experts:
        ffn = m.expert_ffn_dim or m.ffn_dim
        mlp = 2 * ffn * ((m.experts_per_token or 1) + (m.num_shared_experts or 0))
        return Terms(seq=a * 2 * D + c * 2 * D, gathered=c * (mlp + m.num_experts), tp=c * (q_dim + 2 * kv_dim))
    inputs = 1 if m.family == "gpt2" else 2  # GPT-2's fc; SwiGLU's w1 and w3
    return Terms(seq=a * 2 * D + c * 2 * D, tp=c * (q_dim + 2 * kv_dim + inputs * m.ffn_dim))


def head_weight_pass_pending_terms(m: ModelConfig, d: ActDtypes) -> Terms:
    """weight_pass_pending_terms of the last stage's head: the final norm's output gradient and the
    output projection's (the logits' gradient: a rank's vocabulary shard under tp)."""
    return Terms(seq=d.stream * m.dim, tp=d.compute * m.vocab_size)


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


def _attention_backward(m: ModelConfig, d: ActDtypes, cp: int) -> Terms:
    """The attention's backward at its peak, beyond what it saved. Fused: the gradients of q, k, v
    and out. Math: inside softmax's backward, the gradients of the probabilities (from the second
    bmm's backward) and of the scores (its output), both fp32 [H, queries, keys], while the fp32
    gradient of v (expanded under GQA) waits for its own path (its nodes were made earlier, so
    the engine runs them later)."""
    _, q_dim, kv_dim, H, _ = _shapes(m)
    if not d.math_attention:
        return Terms(tp=d.compute * (2 * q_dim + 2 * kv_dim))
    per_query, per_call = _keys_per_query(cp)
    v = q_dim if m.num_kv_heads != m.num_heads else kv_dim
    return Terms(tp=FP32 * v * per_call, per_key=2 * FP32 * H * per_query)


def attention_backward_freed(m: ModelConfig, d: ActDtypes) -> Terms:
    """What a dense block has freed of what it saved (or its recompute rebuilt) when its attention's
    backward runs, after its MLP's and output projection's: the MLP's tensors, its norm's, the
    mid-block residual the norm saved, and the output projection's input. MoE blocks: none counted
    (their experts' tensors are freed expert by expert, routed_backward_moments)."""
    if m.num_experts:
        return Terms()
    _, q_dim, _, _, _ = _shapes(m)
    c = d.compute
    residual = d.stream * m.dim if m.family == "gpt2" else FP32 * m.dim
    mlp = 2 * c * m.ffn_dim if m.family == "gpt2" else _swiglu_saved(c, m.ffn_dim)
    return Terms(seq=residual, tp=mlp + c * q_dim) + _norm(m, d, _ffn_consumers(m))


def backward_transient_terms(m: ModelConfig, d: ActDtypes, routing: Routing | None = None,
                             sequence_parallel: bool = False, policy: str = "none", cp: int = 1) -> Transient:
    """Bytes while one block runs its backward, beyond its saved activations (measured on CPU):
    the MLP's intermediate gradients (SwiGLU: the gradients of the w2 input, of silu out and of
    w3 out, 3 F, once the w2 input is freed; GELU MLP: the gradients of the GELU output and input,
    2 F, once the GELU output is freed) or the attention's gradients, plus the stream's gradient.
    MoE: the largest of the shared experts' SwiGLU and the largest single routed computation
    (`Routing.busiest`: the busiest dropless expert, or all capacity buffers at once); the experts'
    backwards run one at a time, so only the largest one's gradients exist at once."""
    D, q_dim, kv_dim, _, _ = _shapes(m)
    c = d.compute
    # Under autocast the residual add (fp32 + bf16 branch) also casts the gradient for the branch.
    grad_cast = Terms(seq=c * D if d.autocast else 0)
    # The MLP's input held by its forward: saved itself (so rebuilt) unless autocast saves its casts.
    tail = Terms(seq=d.stream * D, gathered=d.stream * D if sequence_parallel else 0) if d.autocast else Terms()
    expert = {}
    if m.family == "gpt2":
        # fp32/16-bit: GELU's backward (its input's and output's gradients, fc2's input freed);
        # autocast: inside fc2's backward (its input's gradient, before the fp32 cast-back).
        hidden, grads = m.ffn_dim, 1 if d.autocast else 2
    elif m.num_experts:
        # mlp_*: the shared experts' SwiGLU, whose backward runs first; expert_*: the routed ones'.
        F, busiest = m.expert_ffn_dim, (routing or _balanced(m)).busiest
        hidden, grads = m.num_shared_experts * F, 3
        # The routed output; with shared experts their sum, and their output unless the policy kept it.
        shared_output = 0 if _policy_keeps_shared_output(m, routing or _balanced(m), policy) else c * D
        tail += Terms(gathered=d.stream * D + (d.stream * D + shared_output if m.num_shared_experts else 0))
        expert = dict(expert_output=Terms(gathered=3 * d.stream * D * busiest),
                      expert_output_freed=Terms(gathered=d.stream * D * busiest),
                      expert_hidden=Terms(gathered=2 * c * F * busiest),
                      expert_accumulation=Terms(gathered=c * F * busiest),
                      expert_input_grad=Terms(gathered=d.stream * D))
    else:
        hidden, grads = m.ffn_dim, 3
    split = "gathered" if m.num_experts else "tp"  # an MoE's shared experts are whole on the tp ranks
    # An MoE's output is in the stream's dtype (its fp32 routing weights promote it): no cast.
    branch_bytes = d.stream if m.num_experts else c
    branch_grad = Terms(gathered=branch_bytes * D) if sequence_parallel else Terms() if m.num_experts else grad_cast
    return Transient(grad_stream=Terms(seq=d.stream * D), grad_cast=grad_cast, branch_grad=branch_grad,
                     attention=_attention_backward(m, d, cp), mlp_new=Terms(**{split: grads * c * hidden}),
                     mlp_freed=Terms(**{split: c * hidden if grads > 1 else 0}), recompute_tail=tail, **expert)


# ---------------------------------------------------------------- Korthikanti et al. (2022)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one GPT-3 transformer layer in 16-bit (Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Sec. 4), summed term
    by term as the paper derives it: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel.

    Without recomputation: sbh(34 + 5as/h); with tensor parallelism only the attention and MLP
    internals shrink: sbh(10 + 24/t + 5as/(ht)); with sequence parallelism too, everything /t.
    Selective recomputation (of the attention core) drops the 5as/h term; full keeps the layer
    input, 2sbh (/t with sequence parallelism).
    """
    sbh = s * b * h
    # (bytes per sbh, divided by t under TP alone?) -- Sec. 4.1 and 4.2.
    attention = [
        (2, False),  # QKV matmul input
        (4, True),  # Q and K for QK^T
        (2, True),  # V
        (2, True),  # input of the output projection (attention output)
        (1, False),  # attention dropout mask
    ]
    attention_core = 5 * a * s / h  # softmax output 2as^2b, its dropout mask as^2b, dropout output 2as^2b
    mlp = [(2, False), (8, True), (8, True), (1, False)]  # fc1 input, fc1 out (GELU in), GELU out, dropout mask
    norms = [(2, False), (2, False)]  # the two LayerNorm inputs
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    per_layer = 0.0
    for coef, parallel in attention + mlp + norms:
        per_layer += coef / t if (parallel or sequence_parallel) else coef
    if recompute != "selective":
        per_layer += attention_core / t
    return sbh * per_layer
