"""Training FLOPs per token and MFU, in closed form from the model config. Torch-free.

Model FLOPs follow Kaplan et al. 2020 / PaLM (Chowdhery et al. 2022, appendix B): a matmul with
N weights costs 2N FLOPs per token forward and 4N backward, so 6N per token; attention adds
QK^T and AV, 2 x 2*s*d per token per layer forward (here halved: causal masking skips the upper
triangle, as flash attention does). Embedding lookups are not matmuls and cost nothing.
"""

from __future__ import annotations

from trainfit.config import ModelConfig

FWD_BWD_FACTOR = 3  # backward = 2x forward (grad wrt inputs + grad wrt weights)


def matmul_params_per_token(m: ModelConfig) -> int:
    """Weights each token multiplies through (MoE: router + shared + top-k routed experts only)."""
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
    return m.num_layers * (q_and_o + k_and_v + mlp) + m.dim * m.vocab_size


def attention_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs of QK^T and AV per token, causal (average context seq_len / 2)."""
    head_dim = m.dim // m.num_heads
    return m.num_layers * 2 * 2 * m.num_heads * head_dim * seq_len // 2


def training_flops_per_token(m: ModelConfig, seq_len: int) -> int:
    """Model FLOPs of forward + backward per token (no recomputation counted: that is MFU's convention)."""
    forward = 2 * matmul_params_per_token(m) + attention_flops_per_token(m, seq_len)
    return FWD_BWD_FACTOR * forward


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the device's dense peak."""
    return tokens_per_s * flops_per_token / peak_flops
