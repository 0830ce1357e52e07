"""Parameter counts in closed form from the config, per component. Torch-free.

A test builds every preset and HF family on the meta device and checks these numbers equal
`count_params` of the real module tree, so the estimator and the trainer can never disagree.
"""

from __future__ import annotations

from typing import NamedTuple

from trainfit.config.schema import ModelConfig


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

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def total(self) -> int:
        return self.embedding + self.num_layers * self.per_layer + self.final_norm + self.output

    @property
    def active(self) -> int:
        """Parameters one token passes through (MoE: only its top-k experts)."""
        return self.total - self.num_layers * (self.mlp - self.mlp_active)


def param_counts(m: ModelConfig) -> ParamCounts:
    d, head_dim = m.dim, m.dim // m.num_heads
    q_dim, kv_dim = m.num_heads * head_dim, m.num_kv_heads * head_dim
    if m.family == "gpt2":
        return ParamCounts(
            embedding=(m.vocab_size + m.max_seq_len) * d,
            attention=4 * d * d + 4 * d,  # q, k, v, o with biases
            mlp=2 * d * m.ffn_dim + m.ffn_dim + d,
            mlp_active=2 * d * m.ffn_dim + m.ffn_dim + d,
            routed_experts=0,
            norms=2 * 2 * d,  # two LayerNorms, weight and bias
            final_norm=2 * d,
            output=0 if m.tie_embeddings else m.vocab_size * d,
            num_layers=m.num_layers,
        )
    attention = d * q_dim + 2 * d * kv_dim + q_dim * d + (q_dim + 2 * kv_dim if m.qkv_bias else 0)
    if m.num_experts:
        expert = 3 * d * m.expert_ffn_dim
        routed = m.num_experts * expert
        router_and_shared = d * m.num_experts + m.num_shared_experts * expert
        mlp, mlp_active = router_and_shared + routed, router_and_shared + m.experts_per_token * expert
    else:
        routed, mlp = 0, 3 * d * m.ffn_dim
        mlp_active = mlp
    return ParamCounts(
        embedding=m.vocab_size * d,
        attention=attention,
        mlp=mlp,
        mlp_active=mlp_active,
        routed_experts=routed,
        norms=2 * d,
        final_norm=d,
        output=0 if m.tie_embeddings else m.vocab_size * d,
        num_layers=m.num_layers,
    )


def format_count(n: int) -> str:
    """A parameter count as people write it: 6.74B, 3.28M, 12.5K, 512."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}" if n < 100 * scale else f"{n / scale:.0f}{unit}"
    return str(n)
