"""Llama-style decoder (Llama 2/3, Mistral, Mixtral, Qwen2/3): RMSNorm, RoPE, GQA, SwiGLU; QK-norm
and any head width where the architecture (models/architecture.py) has them.

Module names follow torchtitan so tensor-parallel plans and HF conversion can address them:
`tok_embeddings`, `layers.{i}.attention_norm`, `layers.{i}.attention.{wq,wk,wv,wo,q_norm,k_norm}`,
`layers.{i}.ffn_norm`, `layers.{i}.feed_forward.{w1,w2,w3}` (or the MoE of moe.py), `norm`, `output`.
RoPE uses the HF "rotate_half" layout, so HF q/k weights load without a permutation.

Shape suffixes: B batch, T sequence, D model dim, H query heads, G key/value heads,
K head dim, F feed-forward hidden, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainfit.config.schema import ModelConfig
from trainfit.models.architecture import Attention as AttentionSpec
from trainfit.models.architecture import describe
from trainfit.models.common import FeedForward, LayerStack, WholeSequence, output_head, window_mask
from trainfit.models.init import init_parameters
from trainfit.models.moe import MoE


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 and cast back before the gain, as HF Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_f32 = x_BTD.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x_BTD.dtype)


def rope_tables(cfg: ModelConfig, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in fp32, frequencies repeated twice (rotate_half
    layout), with Llama 3.1's scaling when model.rope_scaling_factor is set."""
    head_dim = describe(cfg).block.attention.head_dim
    inv_freq_K2 = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if cfg.rope_scaling_factor:
        inv_freq_K2 = llama31_scaled_frequencies(inv_freq_K2, cfg)
    pos_T = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    angles_TK = torch.outer(pos_T, inv_freq_K2).repeat(1, 2)
    return angles_TK.cos(), angles_TK.sin()


def llama31_scaled_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (the reference implementation's apply_scaling; HF rope_type
    "llama3"): a frequency whose wavelength is longer than original_context / low_freq_factor is
    divided by `factor`, one shorter than original_context / high_freq_factor is kept, and those
    between are interpolated linearly in original_context / wavelength."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    context = cfg.rope_original_max_seq_len
    wavelength = 2 * math.pi / inv_freq
    smooth = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long waves, 1: short ones
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def apply_rope(x_BHTK: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor) -> torch.Tensor:
    half = x_BHTK.shape[-1] // 2
    rotated = torch.cat((-x_BHTK[..., half:], x_BHTK[..., :half]), dim=-1)
    return x_BHTK * cos_TK.to(x_BHTK.dtype) + rotated * sin_TK.to(x_BHTK.dtype)


class Attention(nn.Module):
    """Causal GQA self-attention through SDPA.

    Head counts are read from the projection shapes at run time, so a tensor-parallel plan that
    shards wq/wk/wv column-wise (fewer local heads) needs no change here.
    """

    def __init__(self, dim: int, spec: AttentionSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(dim, spec.q_dim, bias=spec.qkv_bias)
        self.wk = nn.Linear(dim, spec.kv_dim, bias=spec.qkv_bias)
        self.wv = nn.Linear(dim, spec.kv_dim, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.q_dim, dim, bias=spec.out_bias)
        # QK-norm over each head's K features of [B, T, H, K] (tensor parallelism shards H), or over
        # all of q's H x K and k's G x K (whole)
        self.qk_norm_whole = spec.qk_norm_whole
        if spec.qk_norm:
            q_width, kv_width = (spec.q_dim, spec.kv_dim) if spec.qk_norm_whole else (spec.head_dim, spec.head_dim)
            self.q_norm: RMSNorm | None = RMSNorm(q_width, spec.qk_norm.eps)
            self.k_norm: RMSNorm | None = RMSNorm(kv_width, spec.qk_norm.eps)
        else:
            self.q_norm = self.k_norm = None
        self.sequence = WholeSequence()
        """Causal attention over the whole sequence; context parallelism swaps in its own."""

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                window_TT: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q, k = self.wq(x_BTD), self.wk(x_BTD)
        if self.q_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BTHK, k_BTGK = q.view(B, T, -1, self.head_dim), k.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BHTK, k_BGTK = q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2)
        v_BGTK = self.wv(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        q_BHTK, k_BGTK = apply_rope(q_BHTK, cos_TK, sin_TK), apply_rope(k_BGTK, cos_TK, sin_TK)
        o_BHTK = self.sequence.attention(q_BHTK, k_BGTK, v_BGTK, window_TT)
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block; called as block(x_BTD, cos_TK, sin_TK, window_TT) with positional arguments only,
    so torch.utils.checkpoint and torch.compile can wrap it as is (window_TT: common.window_mask's, or None)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        layer = describe(cfg).block
        self.post_norm = layer.norm_placement == "post"
        if self.post_norm:  # OLMo 2: attention_post_norm and ffn_post_norm after the branches
            self.attention_post_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, layer.attention)
        if self.post_norm:
            self.ffn_post_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.num_experts:
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                window_TT: torch.Tensor | None = None) -> torch.Tensor:
        if self.post_norm:
            h_BTD = x_BTD + self.attention_post_norm(self.attention(x_BTD, cos_TK, sin_TK, window_TT))
            return h_BTD + self.ffn_post_norm(self.feed_forward(h_BTD))
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_TK, sin_TK, window_TT)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Transformer(nn.Module):
    """The decoder. forward(tokens_BT) -> logits_BTV; after each forward `aux_loss` holds the sum of
    the MoE load-balancing losses over layers (a 0-dim zero for dense models).

    `tok_embeddings`, `norm` and `output` may be set to None by a pipeline split: a stage without
    embeddings takes hidden states as input, a stage without output returns hidden states.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = LayerStack([TransformerBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos_TK, sin_TK = rope_tables(cfg)
        # Non-persistent: derived from the config, never saved, recomputed by init_weights().
        self.register_buffer("rope_cos", cos_TK, persistent=False)
        self.register_buffer("rope_sin", sin_TK, persistent=False)
        self.aux_loss = torch.zeros(())
        self.window = describe(cfg).block.attention.window
        """Every layer's sliding window (0: none), read once here rather than in each forward."""
        self.project_logits = True
        """False: forward returns the final norm's output and the loss projects it chunk by chunk
        (memory.chunked_loss, train/loss.py), so the whole logits never exist."""
        self.sequence = WholeSequence()
        """Which positions this rank's tokens are (context parallelism: not the first T)."""
        self.input_shards = 1
        """How many ranks share the positions of the input: tp for a pipeline stage that takes hidden
        states sharded along the sequence (sequence parallelism), else 1."""

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        h_BTD = self.tok_embeddings(tokens_BT) if self.tok_embeddings is not None else tokens_BT
        # The input's T, not h_BTD's: under sequence parallelism that holds 1/tp of the positions.
        rows = self.sequence.rows(tokens_BT.shape[1] * self.input_shards)
        cos_TK, sin_TK = self.rope_cos[rows], self.rope_sin[rows]
        window_TT = window_mask(cos_TK.shape[0], self.window, h_BTD)
        for block in self.layers:
            h_BTD = block(h_BTD, cos_TK, sin_TK, window_TT)
        self.aux_loss = collect_aux_loss(self.layers, h_BTD.device)
        return output_head(self, h_BTD)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter this rank holds from `seed` (models/init.py: the same values on every
        layout) and rebuild the RoPE tables."""
        init_parameters(self, seed=seed, num_layers=self.cfg.num_layers)
        cos_TK, sin_TK = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos_TK)
        self.rope_sin.copy_(sin_TK)


def collect_aux_loss(layers: LayerStack, device: torch.device) -> torch.Tensor:
    """Sum of the per-layer MoE auxiliary losses of the last forward (zero when there is none)."""
    total = torch.zeros((), device=device)
    for block in layers:
        layer_aux = getattr(block.feed_forward, "aux_loss", None)
        if layer_aux is not None:
            total = total + layer_aux
    return total
