"""What one transformer block and the output head cost per token, in config terms. Torch-free.

A matmul with N weights costs 2N FLOPs per token forward (Kaplan et al. 2020; PaLM, Chowdhery et
al. 2022, appendix B); attention adds QK^T and AV, 2 x 2*s*d per token per layer forward, halved
under causal masking (flash attention skips the upper triangle). MoE blocks count what a token
passes through: router, shared experts and its top-k routed experts. perf/flops.py builds the
training and hardware FLOPs on these; parallel/stage_split.py weighs pipeline stages with them.
"""

from __future__ import annotations

from trainfit.config.schema import ModelConfig


def block_matmul_params(m: ModelConfig) -> int:
    """Weights one token multiplies through in one block (MoE: router + shared + its top-k experts)."""
    head_dim = m.dim // m.num_heads
    q_and_o = 2 * m.dim * m.num_heads * head_dim
    k_and_v = 2 * m.dim * m.num_kv_heads * head_dim
    if m.family == "gpt2":
        mlp = 2 * m.dim * m.ffn_dim
    elif m.num_experts:
        expert = 3 * m.dim * m.expert_ffn_dim
        mlp = m.dim * m.num_experts + (m.experts_per_token + m.num_shared_experts) * expert
    else:
        mlp = 3 * m.dim * m.ffn_dim
    return q_and_o + k_and_v + mlp


def head_matmul_params(m: ModelConfig) -> int:
    """The output projection (a matmul even when its weight is tied to the embedding)."""
    return m.dim * m.vocab_size


def block_attention_flops(m: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Forward FLOPs of QK^T and AV per token in one block; causal halves the average context."""
    head_dim = m.dim // m.num_heads
    full = 2 * 2 * m.num_heads * head_dim * seq_len
    return full // 2 if causal else full
