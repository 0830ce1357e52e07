"""Parameter counts in closed form from the config, per component. Torch-free.

A test builds every preset and HF family on the meta device and checks these numbers equal
`count_params` of the real module tree, so the estimator and the trainer can never disagree.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import Layer, config_key, describe


class ParamCounts(NamedTuple):
    embedding: int
    """Token (and GPT-2 position) embeddings."""
    attention: int
    """One block's attention projections (and their biases)."""
    mlp: int
    """One block's dense MLP, or its MoE: router + all routed experts + shared experts."""
    mlp_active: int
    """What one token uses of `mlp`: router + top-k routed experts + shared experts."""
    routed_experts: int
    """One block's routed-expert weights (sharded by expert parallelism); 0 for dense models."""
    norms: int
    """One block's norm parameters."""
    final_norm: int
    output: int
    """Output projection; 0 when tied to the embedding."""
    num_layers: int
    blocks: int
    """Every block's parameters together. The per-block fields above are the last layer's: where layers
    differ in their tensors (dense and MoE), each kind's are param_counts of it (architecture.layer_kinds)."""
    blocks_active: int
    """What one token uses of `blocks`."""

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def total(self) -> int:
        return self.embedding + self.blocks + self.final_norm + self.output

    @property
    def active(self) -> int:
        """Parameters one token passes through (MoE: only its top-k experts)."""
        return self.total - self.blocks + self.blocks_active


def param_counts(m: ModelConfig) -> ParamCounts:
    return _param_counts(config_key(m))


@functools.lru_cache(maxsize=1024)
def _param_counts(key: tuple) -> ParamCounts:
    """param_counts, once per config (a sum over the layers, which the planner asks for per candidate)."""
    arch = describe(ModelConfig(*key))
    d = arch.dim
    layer = arch.layers[-1]
    moe = layer.moe
    mlp = layer.ffn.params(d)

    def active(la: Layer) -> int:
        return la.attention.params(d) + la.norm_params(d) + (la.moe.active_params(d) if la.moe else la.ffn.params(d))

    return ParamCounts(
        embedding=arch.embedding_params,
        attention=layer.attention.params(d),
        mlp=mlp,
        mlp_active=moe.active_params(d) if moe else mlp,
        routed_experts=moe.experts * moe.routed_expert_params(d) if moe else 0,
        norms=layer.norm_params(d),
        final_norm=arch.final_norm.params(d),
        output=0 if arch.tie_embeddings else arch.vocab_size * d,
        num_layers=len(arch.layers),
        blocks=sum(la.attention.params(d) + la.ffn.params(d) + la.norm_params(d) for la in arch.layers),
        blocks_active=sum(active(la) for la in arch.layers),
    )


def format_count(n: int) -> str:
    """A parameter count as people write it: 6.74B, 3.28M, 12.5K, 512."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= 0.9995 * scale:  # what rounds to 1000 of the unit below is 1 of this one (1B, not 1000M)
            return f"{n / scale:.3g}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)
