"""The one description of a model's architecture: embedding, each layer's attention, norms and
feed-forward, the head. Torch-free.

Built from a resolved ModelConfig by `describe` and read by the model's modules (llama.py, gpt2.py),
the linears' list (block_spec.py), the parameter count (params.py), the FLOP count (block_cost.py)
and both memory estimators, so that a feature (QK-norm, a head width other than dim / heads, a
LayerNorm) is a field read where it matters, not a model family branched on in each module. A
model's layers are a tuple of `Layer`s, one per layer, so a model whose layers differ (dense layers
before MoE ones, local and global attention) is data. Layers that differ in their tensors (dense and
MoE) are kinds (`layer_kinds`): what prices one block reads a kind, what prices a stage sums its
blocks' kinds. `Architecture.block` is the layer whose tensors every layer has, which is what a kind
prices per layer: the layers themselves when they are alike, or when they differ only in their
attention's span (Gemma's windowed and global layers, each with its RoPE base) that layer with the
span left unset, so that what depends on it (the attention's FLOPs, its masks, the RoPE tables)
reads `Architecture.layers`.

`model.family` is read here only, as a name for a bundle of features (llama: RMSNorm, RoPE, SwiGLU,
no biases but optional q/k/v ones; gpt2: LayerNorm, learned positions, tanh-GELU MLP, biases
everywhere), and by models/__init__.py to pick the module tree that computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Literal

from trainfit.config.schema import ModelConfig

NormKind = Literal["rms", "layer"]
"""rms: RMSNorm, a gain only, computed in fp32 (HF Llama's); layer: LayerNorm with gain and bias."""


@dataclass(frozen=True)
class Norm:
    kind: NormKind
    eps: float
    offset: bool = False
    """Gemma's RMSNorm: the gain is (1 + w) (w stored, initialised at 0), multiplied in fp32 before the
    cast back to the input's dtype."""
    fp32_gain: bool = False
    """gpt-oss's RMSNorm: the gain w multiplied in fp32 before the cast back (Llama's casts first)."""

    @property
    def gain_in_fp32(self) -> bool:
        """Whether the gain multiplies the fp32 normed values (saving them in fp32), not their cast back."""
        return self.offset or self.fp32_gain

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
    scale: float
    """What the queries' dot products with the keys are multiplied by: 1 / sqrt(head_dim), or Gemma's
    1 / sqrt(query_pre_attn_scalar)."""
    qk_norm: Norm | None
    """RMSNorm on q and on k before RoPE (model.qk_norm): over each head, a gain of head_dim shared by
    the heads (Qwen3), or with `qk_norm_whole` over all heads at once, a gain of q_dim and one of kv_dim
    (OLMo 2)."""
    qk_norm_whole: bool = False
    softcap: float = 0.0
    """Gemma 2's soft-capped scores, c tanh(s / c) (0: none): an eager attention, not SDPA."""
    window: int | None = 0
    """A sliding window: each query attends its `window` latest positions, itself included (Mistral 7B
    v0.1, Phi-3-mini, Gemma's local layers); 0 = every earlier position; None in `Architecture.block`
    when the layers' windows differ."""
    rope_theta: float | None = 10000.0
    """The RoPE base (None in `Architecture.block` when the layers' differ)."""
    rope_scaled: bool | None = False
    """Whether model.rope_scaling_factor applies to this layer's RoPE (None as rope_theta)."""
    sinks: bool = False
    """gpt-oss's attention sinks: a learned logit per query head in each query's softmax (model.attention_sinks);
    an eager attention on every device (eager_attention)."""

    def _span(self) -> int:
        if self.window is None:
            raise ValueError("the layers' windows differ: read Architecture.layers one by one")
        return self.window

    def keys_per_query(self, seq_len: int) -> float:
        """The keys a query attends on average over a causal sequence of seq_len (window or not)."""
        w = min(self._span() or seq_len, seq_len)
        return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

    def masked(self, seq_len: int) -> bool:
        """Whether its SDPA takes an explicit mask at seq_len (a window shorter than the sequence)."""
        return 0 < self._span() < seq_len

    @property
    def rope_key(self) -> tuple[float, bool] | None:
        """What its RoPE tables depend on besides the model (None without RoPE): layers with the same key
        share one pair of cos/sin tables."""
        if not self.rope:
            return None
        if self.rope_theta is None:
            raise ValueError("the layers' RoPE differs: read Architecture.layers one by one")
        return self.rope_theta, bool(self.rope_scaled)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def params(self, dim: int) -> int:
        """The projections' weights and biases (QK-norm's gains are norm_params)."""
        weights = dim * self.q_dim + 2 * dim * self.kv_dim + self.q_dim * dim
        biases = (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (dim if self.out_bias else 0)
        return weights + biases + (self.num_heads if self.sinks else 0)

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
    """w2(act(w1 x) * w3 x): SwiGLU with silu, GeGLU with gelu_tanh (Gemma); else w2(act(w1 x)) (GPT-2)."""
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
    normalize_topk: bool = True
    """Each token's top-k routing weights renormalised to sum to 1 (False: the softmax's, OLMoE)."""
    router_bias: bool = False
    bias: bool = False
    """Biases on each routed expert's gate, up and down projections (gpt-oss; shared experts have none)."""
    swiglu_limit: float = 0.0
    """0: silu(w1 x) * w3 x; L > 0: gpt-oss's clamped form (model.swiglu_limit), with swiglu_alpha."""
    swiglu_alpha: float = 1.702

    def expert_params(self, dim: int) -> int:
        """One shared expert's (a SwiGLU without biases)."""
        return 3 * dim * self.hidden

    def routed_expert_params(self, dim: int) -> int:
        """One routed expert's: its three matrices, and their biases when it has them."""
        return self.expert_params(dim) + (2 * self.hidden + dim if self.bias else 0)

    def router_params(self, dim: int) -> int:
        return dim * self.experts + (self.experts if self.router_bias else 0)

    def params(self, dim: int) -> int:
        return self.router_params(dim) + self.experts * self.routed_expert_params(dim) + \
            self.shared * self.expert_params(dim)

    def active_params(self, dim: int) -> int:
        return self.router_params(dim) + self.top_k * self.routed_expert_params(dim) + \
            self.shared * self.expert_params(dim)


NormPlacement = Literal["pre", "post", "sandwich"]


@dataclass(frozen=True)
class Layer:
    """One transformer layer: attention, then the feed-forward, each added to the stream with its norm
    before it (pre: x + f(norm(x))), after it (post: x + norm(f(x))) or both (sandwich: x +
    norm(f(norm(x))), Gemma's four norms)."""

    attention: Attention
    ffn: DenseMlp | Moe
    norm: Norm
    norm_placement: NormPlacement = "pre"

    @property
    def stream_norms(self) -> int:
        """The norms of dim on the residual stream's branches: two, four when sandwiched."""
        return 4 if self.norm_placement == "sandwich" else 2

    def norm_params(self, dim: int) -> int:
        """Every norm's parameters: the branches' norms and QK-norm's."""
        return self.stream_norms * self.norm.params(dim) + self.attention.norm_params

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
    embedding_scale: bool = False
    """The token embeddings are multiplied by sqrt(dim), rounded to the parameters' dtype (Gemma)."""
    final_softcap: float = 0.0
    """The logits l become c tanh(l / c) (Gemma 2; 0: none)."""

    @functools.cached_property
    def block(self) -> Layer:
        """The layer whose tensors every layer has (module docstring): the layer itself when all are alike;
        when they differ only in their attention's span (window, RoPE base and scaling), that layer with
        the span unset (None); otherwise a ValueError."""
        first = self.layers[0]
        if all(layer == first for layer in self.layers[1:]):
            return first
        unspanned = {_unspanned(layer) for layer in set(self.layers)}
        if len(unspanned) > 1:
            raise ValueError("the model's layers differ in their tensors; read Architecture.layers one by one")
        return unspanned.pop()

    @functools.cached_property
    def attention(self) -> Attention:
        """The attention every layer has: its span unset (None) where the layers' spans differ; a ValueError
        where its tensors differ."""
        kinds = {_unspanned(layer).attention for layer in set(self.layers)}  # (cached: the planner asks often)
        if len(kinds) > 1:
            raise ValueError("the model's attention layers differ in their tensors; read Architecture.layers")
        return self.layers[0].attention if len(set(la.attention for la in self.layers)) == 1 else kinds.pop()

    @property
    def norm(self) -> Norm:
        """The norm of every layer's branches."""
        return self.layers[0].norm

    def masked_windows(self, seq_len: int) -> tuple[int, ...]:
        """The distinct windows shorter than seq_len among the layers: one explicit mask each per forward
        (once per length: the planner's estimates ask for each layout)."""
        found = self._masked_windows.get(seq_len)
        if found is None:
            found = self._masked_windows[seq_len] = tuple(sorted(
                {la.attention.window for la in self.layers if la.attention.masked(seq_len)}))
        return found

    @functools.cached_property
    def _masked_windows(self) -> dict[int, tuple[int, ...]]:
        return {}

    @functools.cached_property
    def rope_keys(self) -> tuple[tuple[float, bool], ...]:
        """The distinct RoPE settings among the layers: one pair of cos/sin tables each."""
        return tuple(dict.fromkeys(la.attention.rope_key for la in self.layers if la.attention.rope))

    @functools.cached_property
    def sinks(self) -> bool:
        """Whether some layer's attention has sinks (models/eager_attention.py)."""
        return any(la.attention.sinks for la in self.layers)

    @property
    def embedding_params(self) -> int:
        return (self.vocab_size + (self.max_seq_len if self.learned_positions else 0)) * self.dim


def _unspanned(layer: Layer) -> Layer:
    return dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, window=None, rope_theta=None,
                                                                    rope_scaled=None))


_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(ModelConfig)))
"""A ModelConfig's field values, in order (scalars and tuples): the key of the caches below, as
ModelConfig itself is mutable. Shallow: dataclasses.astuple would deep-copy them, on the planner's hot
path (it describes each candidate's model many times)."""


def config_key(m: ModelConfig) -> tuple:
    """What a ModelConfig is, hashable: the key of every cache of what depends on the model alone."""
    return _FIELDS(m)


def describe(m: ModelConfig) -> Architecture:
    """The architecture of a resolved ModelConfig (every field set; see presets.resolve_model_config)."""
    return _describe(config_key(m))


@functools.lru_cache(maxsize=256)
def _describe(fields: tuple) -> Architecture:
    """describe, once per config (the planner asks for each candidate's many times)."""
    m = ModelConfig(*fields)
    gpt2 = m.family == "gpt2"  # the feature bundle a family name stands for (module docstring)
    norm = Norm("layer" if gpt2 else "rms", m.norm_eps, offset=bool(m.norm_offset), fp32_gain=bool(m.norm_fp32_gain))
    width = head_dim(m)
    shapes = dict(
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=width,
        qkv_bias=gpt2 or bool(m.qkv_bias), out_bias=gpt2 or bool(m.attention_out_bias), rope=not gpt2,
        scale=(m.query_pre_attn_scalar or width) ** -0.5,
        qk_norm=norm if m.qk_norm != "none" else None, qk_norm_whole=m.qk_norm == "whole",
        softcap=m.attention_softcap, sinks=bool(m.attention_sinks))
    scaled = bool(m.rope_scaling_factor)
    spans = [dict(window=m.sliding_window or 0, rope_theta=m.rope_theta, rope_scaled=scaled)
             for _ in range(m.num_layers)]
    if m.sliding_window and m.sliding_window_pattern:  # every n-th layer global, with the model's RoPE
        for i, span in enumerate(spans):
            if (i + 1) % m.sliding_window_pattern:
                span["window"] = m.sliding_window
                if m.rope_local_theta:  # the windowed layers' own base, unscaled (Gemma 3)
                    span.update(rope_theta=m.rope_local_theta, rope_scaled=False)
            else:
                span["window"] = 0
    dense = DenseMlp(m.ffn_dim, gated=not gpt2, activation="gelu_tanh" if gpt2 else m.mlp_activation, bias=gpt2)
    moe = Moe(m.num_experts, m.experts_per_token, m.expert_ffn_dim, m.num_shared_experts,
              normalize_topk=bool(m.router_normalize_topk), router_bias=bool(m.router_bias), bias=bool(m.expert_bias),
              swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha) if m.num_experts else None
    kinds: dict[tuple, Layer] = {}  # one Layer object per kind, shared by the layers of that kind
    routed = [moe_layer(m, i) for i in range(m.num_layers)]
    layers = tuple(kinds.setdefault((*span.values(), r), Layer(Attention(**shapes, **span), moe if r else dense, norm,
                                                               m.norm_placement))
                   for span, r in zip(spans, routed, strict=True))
    return Architecture(dim=m.dim, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len, learned_positions=gpt2,
                        layers=layers, final_norm=norm, tie_embeddings=bool(m.tie_embeddings),
                        embedding_scale=bool(m.embedding_scale), final_softcap=m.final_softcap)


def moe_layer(m: ModelConfig, index: int) -> bool:
    """Whether layer `index` (from 0) of `m` has the routed experts: past model.moe_dense_layers, every
    model.moe_layer_step-th (Qwen3-MoE's rule: (index + 1) % decoder_sparse_step == 0)."""
    step = max(1, m.moe_layer_step)  # < 1 is configure/validate.py's error, which describes the model first
    return bool(m.num_experts) and index >= m.moe_dense_layers and (index + 1) % step == 0


def layer_kinds(m: ModelConfig) -> tuple[ModelConfig, ...]:
    """The kinds of layer tensors in `m`, in the order they first appear, each as the config of a model
    whose layers are all of that kind (a dense kind: num_experts 0 and its width ffn_dim). A model whose
    layers are alike, or differ only in their span, is its one kind. What prices one block (its
    parameters, activations, FLOPs, tensor-parallel plan) reads a kind; what prices a stage sums its
    blocks' kinds (`kind_of_layers`)."""
    return _layer_kinds(config_key(m))[0]


def kind_of_layers(m: ModelConfig) -> tuple[int, ...]:
    """Each layer's index into layer_kinds(m)."""
    return _layer_kinds(config_key(m))[1]


@functools.lru_cache(maxsize=256)
def _layer_kinds(fields: tuple) -> tuple[tuple[ModelConfig, ...], tuple[int, ...]]:
    m = ModelConfig(*fields)
    if not m.num_experts or (m.moe_dense_layers, m.moe_layer_step) == (0, 1):
        return (m,), (0,) * m.num_layers
    routed = [moe_layer(m, i) for i in range(m.num_layers)]
    uniform = {True: dataclasses.replace(m, moe_dense_layers=0, moe_layer_step=1),
               False: dataclasses.replace(m, num_experts=0, num_shared_experts=0, moe_dense_layers=0,
                                          moe_layer_step=1)}
    order = list(dict.fromkeys(routed))
    return tuple(uniform[r] for r in order), tuple(order.index(r) for r in routed)


FLEX_DEVICES = ("cuda",)
"""Where soft-capped attention runs FlexAttention (its score_mod and block mask, compiled): torch 2.13's has
no backward on CPU, where the eager attention (models/softcapped_attention.py) runs instead."""


def softcap_kernel(device_type: str) -> Literal["flex", "eager"]:
    """The kernel of a soft-capped attention layer on `device_type` (torch's: "cuda", "cpu"): the model
    runs it and both estimators price what it keeps and computes."""
    return "flex" if device_type in FLEX_DEVICES else "eager"


def eager_attention(attention: Attention, device_type: str) -> bool:
    """Whether a layer's attention runs the eager form (models/eager_attention.py) on `device_type`, keeping
    its [heads, queries, keys] probabilities: attention sinks on every device (no fused kernel here takes
    them), soft-capped scores where FlexAttention has no backward (softcap_kernel). The model runs it; both
    estimators and the time model price it."""
    return attention.sinks or bool(attention.softcap) and softcap_kernel(device_type) == "eager"


def document_mask_kernel(device_type: str, sinks: bool = False) -> Literal["flex", "sdpa"]:
    """How attention over packed samples (data.packing) keeps to each sample on `device_type`: FlexAttention
    with a block mask from the rows' document ids on CUDA (blocks no sample spans are skipped), else SDPA with
    an explicit block-diagonal mask [B, 1, T, T] (torch 2.13's FlexAttention has no backward on CPU). The model
    runs it; both estimators and the time model price what it keeps and computes. With attention `sinks` (their
    eager attention takes an additive mask only) the explicit mask on every device."""
    return "flex" if device_type in FLEX_DEVICES and not sinks else "sdpa"


def head_dim(m: ModelConfig) -> int:
    """Each attention head's width: model.head_dim, or dim / num_heads when it is 0 (unset)."""
    return m.head_dim or m.dim // m.num_heads
