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
from trainfit.models.architecture import Layer, config_key, describe

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
    """Every linear layer of one block of `m` (its layers all alike), in forward order."""
    return _block_linears(config_key(m))


@functools.lru_cache(maxsize=256)
def _block_linears(key: tuple) -> tuple[BlockLinear, ...]:
    """block_linears, once per config: looked up by the config's fields, not by its Layer (a nested frozen
    dataclass, whose hash the planner's estimates would pay on every call)."""
    m = ModelConfig(*key)
    return layer_linears(m.dim, describe(m).block)


@functools.lru_cache(maxsize=256)
def layer_linears(dim: int, layer: Layer) -> tuple[BlockLinear, ...]:
    """Every linear layer of `layer` in a model of width `dim`, in forward order (once per layer kind:
    the planner asks for each candidate's many times)."""
    a = layer.attention
    attention = (BlockLinear("wq", "attention.wq", dim, a.q_dim, a.qkv_bias, "column"),
                 BlockLinear("wk", "attention.wk", dim, a.kv_dim, a.qkv_bias, "column"),
                 BlockLinear("wv", "attention.wv", dim, a.kv_dim, a.qkv_bias, "column"),
                 BlockLinear("wo", "attention.wo", a.q_dim, dim, a.out_bias, "row"))
    mlp = layer.mlp
    if mlp is not None:
        up = (BlockLinear("w1", "feed_forward.w1", dim, mlp.hidden, mlp.bias, "column"),)
        if mlp.gated:
            up += (BlockLinear("w3", "feed_forward.w3", dim, mlp.hidden, mlp.bias, "column"),)
        return (*attention, *up, BlockLinear("w2", "feed_forward.w2", mlp.hidden, dim, mlp.bias, "row"))
    moe = layer.moe
    E, hidden, share = moe.experts, moe.hidden, moe.top_k / moe.experts
    b = moe.bias
    routed = [BlockLinear("router", "feed_forward.router", dim, E, moe.router_bias, "replicated"),
              BlockLinear("experts_w1", "feed_forward.experts.w1", dim, hidden, b, "replicated", E, share),
              BlockLinear("experts_w3", "feed_forward.experts.w3", dim, hidden, b, "replicated", E, share),
              BlockLinear("experts_w2", "feed_forward.experts.w2", hidden, dim, b, "replicated", E, share)]
    shared = moe.shared * hidden  # one SwiGLU of the shared experts' summed width
    if shared:
        routed += [BlockLinear("shared_w1", "feed_forward.shared_experts.w1", dim, shared, False, "replicated"),
                   BlockLinear("shared_w3", "feed_forward.shared_experts.w3", dim, shared, False, "replicated"),
                   BlockLinear("shared_w2", "feed_forward.shared_experts.w2", shared, dim, False, "replicated")]
    return (*attention, *routed)


def tp_split_linears(m: ModelConfig) -> tuple[BlockLinear, ...]:
    """The block's linears tensor parallelism shards (column or row): the plan's entries."""
    return tuple(linear for linear in block_linears(m) if linear.tp != "replicated")
