"""The one description of a model's architecture: embedding, each layer's attention, norms and
feed-forward, the head. Torch-free.

Built from a resolved ModelConfig by `describe` and read by the model's modules (llama.py, gpt2.py),
the linears' list (block_spec.py), the parameter count (params.py), the FLOP count (block_cost.py)
and both memory estimators, so that a feature (QK-norm, a head width other than dim / heads, a
LayerNorm) is a field read where it matters, not a model family branched on in each module. A
model's layers are a tuple of `Layer`s, one per layer, so a model whose layers differ (dense layers
before MoE ones, local and global attention) is data; `Architecture.block` is the layer of a model
whose layers are all alike, which is what the estimators price today.

`model.family` is read here only, as a name for a bundle of features (llama: RMSNorm, RoPE, SwiGLU,
no biases but optional q/k/v ones; gpt2: LayerNorm, learned positions, tanh-GELU MLP, biases
everywhere), and by models/__init__.py to pick the module tree that computes it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig

NormKind = Literal["rms", "layer"]
"""rms: RMSNorm, a gain only, computed in fp32 (HF Llama's); layer: LayerNorm with gain and bias."""


@dataclass(frozen=True)
class Norm:
    kind: NormKind
    eps: float

    def params(self, width: int) -> int:
        """Parameters of one norm over `width` features (gain, and LayerNorm's bias)."""
        return width * (2 if self.kind == "layer" else 1)


@dataclass(frozen=True)
class Attention:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """Any width: Qwen3 and Mistral Small 3 have num_heads x head_dim != dim."""
    qkv_bias: bool
    out_bias: bool
    rope: bool
    """Rotary positions on q and k (False: the model adds learned position embeddings instead)."""
    qk_norm: Norm | None
    """RMSNorm on q and on k before RoPE (model.qk_norm): over each head, a gain of head_dim shared by
    the heads (Qwen3), or with `qk_norm_whole` over all heads at once, a gain of q_dim and one of kv_dim
    (OLMo 2)."""
    qk_norm_whole: bool = False
    window: int = 0
    """A sliding window: each query attends its `window` latest positions, itself included (Mistral 7B
    v0.1, Phi-3-mini); 0 = every earlier position."""

    def keys_per_query(self, seq_len: int) -> float:
        """The keys a query attends on average over a causal sequence of seq_len (window or not)."""
        w = min(self.window or seq_len, seq_len)
        return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

    def masked(self, seq_len: int) -> bool:
        """Whether its SDPA takes an explicit mask at seq_len (a window shorter than the sequence)."""
        return 0 < self.window < seq_len

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def params(self, dim: int) -> int:
        """The projections' weights and biases (QK-norm's gains are norm_params)."""
        weights = dim * self.q_dim + 2 * dim * self.kv_dim + self.q_dim * dim
        return weights + (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (dim if self.out_bias else 0)

    @property
    def norm_params(self) -> int:
        """QK-norm's two gains (0 without it)."""
        if not self.qk_norm:
            return 0
        return self.qk_norm.params(self.q_dim + self.kv_dim) if self.qk_norm_whole else 2 * self.qk_norm.params(
            self.head_dim)

    def qk_norm_rows(self) -> int:
        """The rows QK-norm normalises per token: each head of q and of k, or q and k whole."""
        return 0 if not self.qk_norm else 2 if self.qk_norm_whole else self.num_heads + self.num_kv_heads


Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class DenseMlp:
    hidden: int
    gated: bool
    """SwiGLU-style: w2(act(w1 x) * w3 x); else w2(act(w1 x))."""
    activation: Activation
    bias: bool

    def params(self, dim: int) -> int:
        matrices = 3 if self.gated else 2
        return matrices * dim * self.hidden + ((2 if self.gated else 1) * self.hidden + dim if self.bias else 0)


@dataclass(frozen=True)
class Moe:
    """Routed experts (SwiGLU, no biases) behind a linear router, and optional shared experts."""

    experts: int
    top_k: int
    hidden: int
    """Each routed expert's width (and each shared expert's)."""
    shared: int
    """Shared experts every token passes through: one SwiGLU of shared x hidden."""

    def expert_params(self, dim: int) -> int:
        return 3 * dim * self.hidden

    def params(self, dim: int) -> int:
        return dim * self.experts + (self.experts + self.shared) * self.expert_params(dim)

    def active_params(self, dim: int) -> int:
        return dim * self.experts + (self.top_k + self.shared) * self.expert_params(dim)


NormPlacement = Literal["pre", "post"]


@dataclass(frozen=True)
class Layer:
    """One transformer layer: attention, then the feed-forward, each added to the stream with its norm
    before it (pre: x + f(norm(x))) or after it (post: x + norm(f(x)))."""

    attention: Attention
    ffn: DenseMlp | Moe
    norm: Norm
    norm_placement: NormPlacement = "pre"

    def norm_params(self, dim: int) -> int:
        """Every norm's parameters: the two pre-norms' and QK-norm's."""
        return 2 * self.norm.params(dim) + self.attention.norm_params

    @property
    def moe(self) -> Moe | None:
        return self.ffn if isinstance(self.ffn, Moe) else None

    @property
    def mlp(self) -> DenseMlp | None:
        return self.ffn if isinstance(self.ffn, DenseMlp) else None


@dataclass(frozen=True)
class Architecture:
    dim: int
    vocab_size: int
    max_seq_len: int
    learned_positions: bool
    """GPT-2's position embeddings [max_seq_len, dim] added to the token embeddings."""
    layers: tuple[Layer, ...]
    final_norm: Norm
    tie_embeddings: bool

    @property
    def block(self) -> Layer:
        """The layer of a model whose layers are all alike (every model trainfit builds today)."""
        first = self.layers[0]
        if any(layer != first for layer in self.layers[1:]):
            raise ValueError("the model's layers differ; read Architecture.layers one by one")
        return first

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + (self.max_seq_len if self.learned_positions else 0)) * self.dim


def describe(m: ModelConfig) -> Architecture:
    """The architecture of a resolved ModelConfig (every field set; see presets.resolve_model_config)."""
    return _describe(dataclasses.astuple(m))


@functools.lru_cache(maxsize=256)
def _describe(fields: tuple) -> Architecture:
    """describe, once per config (the planner asks for each candidate's many times)."""
    m = ModelConfig(*fields)
    gpt2 = m.family == "gpt2"  # the feature bundle a family name stands for (module docstring)
    norm = Norm("layer" if gpt2 else "rms", m.norm_eps)
    attention = Attention(
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=head_dim(m),
        qkv_bias=gpt2 or bool(m.qkv_bias), out_bias=gpt2, rope=not gpt2,
        qk_norm=Norm("rms", m.norm_eps) if m.qk_norm != "none" else None, qk_norm_whole=m.qk_norm == "whole",
        window=m.sliding_window or 0)
    ffn: DenseMlp | Moe
    if m.num_experts:
        ffn = Moe(m.num_experts, m.experts_per_token, m.expert_ffn_dim, m.num_shared_experts)
    else:
        ffn = DenseMlp(m.ffn_dim, gated=not gpt2, activation="gelu_tanh" if gpt2 else "silu", bias=gpt2)
    layer = Layer(attention, ffn, norm, m.norm_placement)
    return Architecture(dim=m.dim, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, learned_positions=gpt2,
                        layers=(layer,) * m.num_layers, final_norm=norm, tie_embeddings=bool(m.tie_embeddings))


def head_dim(m: ModelConfig) -> int:
    """Each attention head's width: model.head_dim, or dim / num_heads when it is 0 (unset)."""
    return m.head_dim or m.dim // m.num_heads
