"""What one transformer block and the output head cost per token, in config terms. Torch-free.

A matmul with N weights costs 2N FLOPs per token forward (Kaplan et al. 2020; PaLM, Chowdhery et
al. 2022, appendix B); attention adds QK^T and AV, 2 x 2*s*d per token per layer forward, halved
under causal masking (flash attention skips the upper triangle). MoE blocks count what a token
passes through: router, shared experts and its top-k routed experts. perf/flops.py builds the
training and hardware FLOPs on these; parallel/stage_split.py weighs pipeline stages with them.
"""

from __future__ import annotations

import functools

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import Attention, config_key, describe
from trainfit.models.block_spec import block_linears


def block_matmul_params(m: ModelConfig) -> int:
    """Weights one token multiplies through in one block (MoE: router + shared + its top-k experts)."""
    return sum(round(linear.in_features * linear.out_features * linear.token_share * linear.copies)
               for linear in block_linears(m))


def head_matmul_params(m: ModelConfig) -> int:
    """The output projection (a matmul even when its weight is tied to the embedding)."""
    return m.dim * m.vocab_size


def block_attention_flops(m: ModelConfig, seq_len: int, *, causal: bool = True) -> int:
    """Forward FLOPs of QK^T and AV per token in one block, the mean over the layers (Gemma's windowed and
    global layers differ); causal halves the average context, and a sliding window shorter than the
    sequence bounds it (the keys each query attends: the useful work)."""
    return _mean_attention_flops(config_key(m), seq_len, causal)


@functools.lru_cache(maxsize=4096)
def _mean_attention_flops(key: tuple, seq_len: int, causal: bool) -> int:
    """block_attention_flops, once per config and sequence (a mean over the layers, asked per candidate)."""
    layers = describe(ModelConfig(*key)).layers
    return round(sum(_attention_flops(la.attention, seq_len, causal) for la in layers) / len(layers))


def _attention_flops(a: Attention, seq_len: int, causal: bool) -> float:
    full = 2 * 2 * a.q_dim * seq_len
    if not causal:
        return full
    return 2 * 2 * a.q_dim * a.keys_per_query(seq_len) if a.masked(seq_len) else full // 2


def block_attention_kernel_flops(m: ModelConfig, seq_len: int, *, eager_softcap: bool) -> int:
    """What the attention kernel computes per token in one block (the mean over the layers): the causal
    half without a mask; with a sliding window's explicit mask, SDPA's kernels that take one (CPU flash,
    CUDA memory-efficient) compute every query-key block and mask afterwards, the whole sequence, as
    the eager attention does (`eager_softcap`: architecture.eager_attention; Gemma 2 on the CPU, gpt-oss's sinks
    everywhere); FlexAttention's block mask
    (its CUDA form) skips the blocks outside the causal window: the useful work."""
    return _attention_kernel_flops(config_key(m), seq_len, eager_softcap)


@functools.lru_cache(maxsize=4096)
def _attention_kernel_flops(key: tuple, seq_len: int, eager_softcap: bool) -> int:
    m = ModelConfig(*key)
    layers = describe(m).layers
    if describe(m).attention.softcap or describe(m).attention.sinks:
        return block_attention_flops(m, seq_len, causal=not eager_softcap) if eager_softcap else \
            block_attention_flops(m, seq_len)
    whole = [la.attention.masked(seq_len) for la in layers]
    return round(sum(_attention_flops(la.attention, seq_len, causal=not w) for la, w in zip(layers, whole,
                                                                                            strict=True)) / len(layers))
