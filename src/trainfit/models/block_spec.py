"""The linear layers of one transformer block, described once in config terms: their shapes, how
tensor parallelism splits each, and which are routed experts. Torch-free.

The tensor-parallel plan (parallel/tensor_parallel.py), fp8's conversion filter (perf/fp8_casts.py,
read by trainfit.float8), the time model's GEMMs and per-rank FLOPs (perf/kernels.py,
perf/timing.py), the parameters a rank holds for data parallelism's traffic (perf/comms.py) and
a block's tensor-parallel collectives (parallel/collectives.py) read this list, so none of them
can split a layer differently from the others. A test builds each model family and checks every
nn.Linear and expert weight of a real block against it, and the tensor-parallel plan's placements
against `tp`.

Tensor parallelism (Megatron-LM): attention's wq, wk, wv and a dense MLP's up projections are
column-parallel (out_features / tp per rank), wo and the down projection row-parallel
(in_features / tp). An MoE feed-forward (router, routed and shared experts) is replicated on the
tp ranks and computes on the whole sequence there (Megatron's expert_tensor_parallel_size=1):
expert parallelism, not tp, splits its experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig

TpStyle = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class BlockLinear:
    """One linear layer of a block (a routed expert's: each of the `copies` experts' weight)."""

    name: str
    """Short name the time model and fp8's filter use: wq, wk, wv, wo, w1, w2, w3, router,
    shared_w1..3, experts_w1..3."""
    path: str
    """Its module (routed experts: parameter) path inside the block, as the model names it."""
    in_features: int
    out_features: int
    bias: bool
    tp: TpStyle
    copies: int = 1
    """Routed experts: num_experts stacked weights of this shape (one nn.Parameter)."""
    token_share: float = 1.0
    """The share of the micro-batch's tokens one copy multiplies (routed: top-k / experts, balanced)."""

    @property
    def routed(self) -> bool:
        return self.path.startswith("feed_forward.experts.")

    def local_shape(self, tp: int) -> tuple[int, int]:
        """(in, out) features on one of `tp` tensor-parallel ranks."""
        if self.tp == "column":
            return self.in_features, self.out_features // tp
        if self.tp == "row":
            return self.in_features // tp, self.out_features
        return self.in_features, self.out_features

    def local_params(self, tp: int, ep: int = 1) -> int:
        """Weights and bias on one rank of `tp` x `ep` (expert parallelism splits routed copies)."""
        k, n = self.local_shape(tp)
        bias = (n if self.tp != "row" else self.out_features) if self.bias else 0
        copies = self.copies // ep if self.routed else self.copies
        return copies * (k * n + bias)


def block_linears(m: ModelConfig) -> tuple[BlockLinear, ...]:
    """Every linear layer of one block of `m`, in forward order."""
    return _block_linears(_BlockShape(m.family, m.dim, m.num_heads, m.num_kv_heads, bool(m.qkv_bias), m.ffn_dim,
                                      m.num_experts, m.expert_ffn_dim, m.experts_per_token, m.num_shared_experts))


@dataclass(frozen=True)
class _BlockShape:
    """The fields of a ModelConfig (not hashable) a block's linears depend on."""

    family: str
    dim: int
    num_heads: int
    num_kv_heads: int
    qkv_bias: bool
    ffn_dim: int
    num_experts: int
    expert_ffn_dim: int
    experts_per_token: int
    num_shared_experts: int


@functools.lru_cache(maxsize=256)
def _block_linears(m: _BlockShape) -> tuple[BlockLinear, ...]:
    """block_linears, once per block shape (the planner asks for each candidate's many times)."""
    head_dim = m.dim // m.num_heads
    q, kv = m.num_heads * head_dim, m.num_kv_heads * head_dim
    gpt2 = m.family == "gpt2"
    qkv_bias = gpt2 or m.qkv_bias
    attention = (BlockLinear("wq", "attention.wq", m.dim, q, qkv_bias, "column"),
                 BlockLinear("wk", "attention.wk", m.dim, kv, qkv_bias, "column"),
                 BlockLinear("wv", "attention.wv", m.dim, kv, qkv_bias, "column"),
                 BlockLinear("wo", "attention.wo", q, m.dim, gpt2, "row"))
    if gpt2:
        return (*attention, BlockLinear("w1", "feed_forward.w1", m.dim, m.ffn_dim, True, "column"),
                BlockLinear("w2", "feed_forward.w2", m.ffn_dim, m.dim, True, "row"))
    if not m.num_experts:
        return (*attention, BlockLinear("w1", "feed_forward.w1", m.dim, m.ffn_dim, False, "column"),
                BlockLinear("w3", "feed_forward.w3", m.dim, m.ffn_dim, False, "column"),
                BlockLinear("w2", "feed_forward.w2", m.ffn_dim, m.dim, False, "row"))
    E, hidden, share = m.num_experts, m.expert_ffn_dim, m.experts_per_token / m.num_experts
    moe = [BlockLinear("router", "feed_forward.router", m.dim, E, False, "replicated"),
           BlockLinear("experts_w1", "feed_forward.experts.w1", m.dim, hidden, False, "replicated", E, share),
           BlockLinear("experts_w3", "feed_forward.experts.w3", m.dim, hidden, False, "replicated", E, share),
           BlockLinear("experts_w2", "feed_forward.experts.w2", hidden, m.dim, False, "replicated", E, share)]
    shared = m.num_shared_experts * m.expert_ffn_dim  # one SwiGLU of the shared experts' summed width
    if shared:
        moe += [BlockLinear("shared_w1", "feed_forward.shared_experts.w1", m.dim, shared, False, "replicated"),
                BlockLinear("shared_w3", "feed_forward.shared_experts.w3", m.dim, shared, False, "replicated"),
                BlockLinear("shared_w2", "feed_forward.shared_experts.w2", shared, m.dim, False, "replicated")]
    return (*attention, *moe)


def tp_split_linears(m: ModelConfig) -> tuple[BlockLinear, ...]:
    """The block's linears tensor parallelism shards (column or row): the plan's entries."""
    return tuple(linear for linear in block_linears(m) if linear.tp != "replicated")
