"""Llama-style decoder (Llama 2/3, Mistral, Mixtral, Qwen2/3, Phi-3, OLMo 2, Gemma 3): RMSNorm, RoPE, GQA,
a gated MLP; QK-norm, any head width, post or sandwich norms, Gemma's (1 + w) norms, scaled embeddings and
queries, windowed and global layers with their own RoPE where the architecture (models/architecture.py)
has them.

Module names follow torchtitan so tensor-parallel plans and HF conversion can address them:
`tok_embeddings`, `layers.{i}.attention_norm`, `layers.{i}.attention.{wq,wk,wv,wo,q_norm,k_norm}`,
`layers.{i}.ffn_norm`, `layers.{i}.feed_forward.{w1,w2,w3}` (or the MoE of moe.py), `norm`, `output`;
after the branches (post, sandwich) `layers.{i}.attention_post_norm`, `layers.{i}.ffn_post_norm`.
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
from trainfit.models.architecture import Norm, describe
from trainfit.models.common import FeedForward, LayerStack, WholeSequence, output_head, window_mask
from trainfit.models.document_attention import document_masks, document_positions
from trainfit.models.init import init_parameters
from trainfit.models.moe import MoE
from trainfit.models.rope_scaling import yarn_attention_factor, yarn_frequencies


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32: cast back before the gain, as HF Llama does, or (offset:
    Gemma's) multiplied by (1 + gain) in fp32 and cast back after (fp32_gain: gpt-oss's, by the gain)."""

    def __init__(self, dim: int, eps: float, offset: bool = False, fp32_gain: bool = False) -> None:
        super().__init__()
        self.eps, self.offset, self.fp32_gain = eps, offset, fp32_gain
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_f32 = x_BTD.float()
        normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(x_BTD.dtype)
        if self.fp32_gain:  # gpt-oss's order: the gain on the fp32 values, then the cast
            return (self.weight * normed).to(x_BTD.dtype)
        return self.weight * normed.to(x_BTD.dtype)


def rms_norm(dim: int, norm: Norm) -> RMSNorm:
    return RMSNorm(dim, norm.eps, norm.offset, norm.fp32_gain)


def rope_tables(cfg: ModelConfig, key: tuple[float, bool], device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in fp32 for the layers of RoPE `key` (Attention.rope_key:
    base, scaled), frequencies repeated twice (rotate_half layout), scaled as model.rope_scaling_type
    says when the key is: Llama 3.1's, linear, or YaRN (models/rope_scaling.py; its tables times its attention
    factor)."""
    head_dim = describe(cfg).attention.head_dim
    theta, scaled = key
    inv_freq_K2 = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    sharpen = 1.0
    if scaled and cfg.rope_scaling_type == "linear":
        inv_freq_K2 = inv_freq_K2 / cfg.rope_scaling_factor
    elif scaled and cfg.rope_scaling_type == "yarn":
        inv_freq_K2 = yarn_frequencies(inv_freq_K2, head_dim=head_dim, base=theta, factor=cfg.rope_scaling_factor,
                                       original_max_seq_len=cfg.rope_original_max_seq_len,
                                       beta_fast=cfg.rope_yarn_beta_fast, beta_slow=cfg.rope_yarn_beta_slow,
                                       truncate=bool(cfg.rope_yarn_truncate))
        sharpen = yarn_attention_factor(cfg.rope_scaling_factor, mscale=cfg.rope_yarn_mscale or None,
                                        mscale_all_dim=cfg.rope_yarn_mscale_all_dim or None,
                                        attention_factor=cfg.rope_attention_factor or None)
    elif scaled:
        inv_freq_K2 = llama31_scaled_frequencies(inv_freq_K2, cfg)
    pos_T = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    angles_TK = torch.outer(pos_T, inv_freq_K2).repeat(1, 2)
    return angles_TK.cos() * sharpen, angles_TK.sin() * sharpen


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
        self.head_dim, self.scale, self.softcap, self.window = spec.head_dim, spec.scale, spec.softcap, spec.window
        self.wq = nn.Linear(dim, spec.q_dim, bias=spec.qkv_bias)
        self.wk = nn.Linear(dim, spec.kv_dim, bias=spec.qkv_bias)
        self.wv = nn.Linear(dim, spec.kv_dim, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.q_dim, dim, bias=spec.out_bias)
        # QK-norm over each head's K features of [B, T, H, K] (tensor parallelism shards H), or over
        # all of q's H x K and k's G x K (whole)
        self.qk_norm_whole = spec.qk_norm_whole
        if spec.qk_norm:
            q_width, kv_width = (spec.q_dim, spec.kv_dim) if spec.qk_norm_whole else (spec.head_dim, spec.head_dim)
            self.q_norm: RMSNorm | None = rms_norm(q_width, spec.qk_norm)
            self.k_norm: RMSNorm | None = rms_norm(kv_width, spec.qk_norm)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.sinks else None
        """gpt-oss's attention sinks: one logit per query head in each query's softmax (models/eager_attention.py)."""
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
        o_BHTK = self.sequence.attention(q_BHTK, k_BGTK, v_BGTK, window_TT, self.scale, self.softcap, self.window,
                                         self.sinks)
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    """One layer; called as block(x_BTD, cos_TK, sin_TK, window_TT) with positional arguments only, so
    torch.utils.checkpoint and torch.compile can wrap it as is (window_TT: common.window_mask's, or None).
    Its norms sit before each branch (pre), after it (post: OLMo 2) or both (sandwich: Gemma)."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        layer = describe(cfg).layers[index]
        placement, D = layer.norm_placement, cfg.dim
        self.pre_norms, self.post_norms = placement != "post", placement != "pre"
        if self.pre_norms:
            self.attention_norm = rms_norm(D, layer.norm)
        self.attention = Attention(D, layer.attention)
        if self.post_norms:
            self.attention_post_norm = rms_norm(D, layer.norm)
        if self.pre_norms:
            self.ffn_norm = rms_norm(D, layer.norm)
        if layer.moe:
            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(D, cfg.ffn_dim, layer.mlp.activation)
        if self.post_norms:
            self.ffn_post_norm = rms_norm(D, layer.norm)

    def forward(self, x_BTD: torch.Tensor, cos_TK: torch.Tensor, sin_TK: torch.Tensor,
                window_TT: torch.Tensor | None = None) -> torch.Tensor:
        # Nested calls, no locals but the residual: a branch's output and its norm's are freed as soon as
        # the next operation has read them (a local would keep the attention's through the MLP).
        h_BTD = x_BTD + self._after("attention_post_norm", self.attention(
            self._before("attention_norm", x_BTD), cos_TK, sin_TK, window_TT))
        return h_BTD + self._after("ffn_post_norm", self.feed_forward(self._before("ffn_norm", h_BTD)))

    def _before(self, norm: str, x_BTD: torch.Tensor) -> torch.Tensor:
        return getattr(self, norm)(x_BTD) if self.pre_norms else x_BTD

    def _after(self, norm: str, x_BTD: torch.Tensor) -> torch.Tensor:
        return getattr(self, norm)(x_BTD) if self.post_norms else x_BTD


class Transformer(nn.Module):
    """The decoder. forward(tokens_BT) -> logits_BTV; after each forward `aux_loss` holds the sum of
    the MoE load-balancing losses over layers (a 0-dim zero for dense models).

    `tok_embeddings`, `norm` and `output` may be set to None by a pipeline split: a stage without
    embeddings takes hidden states as input, a stage without output returns hidden states.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        arch = describe(cfg)
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = LayerStack([TransformerBlock(cfg, i) for i in range(cfg.num_layers)])
        self.norm: RMSNorm | None = rms_norm(cfg.dim, arch.final_norm)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.embedding_scale = cfg.dim ** 0.5 if arch.embedding_scale else None
        self.final_softcap = arch.final_softcap
        """Gemma 2's soft-capped logits (0: none), applied by common.output_head and the chunked loss."""
        self.rope_keys = arch.rope_keys
        """The distinct RoPE settings; the tables of the k-th are buffers rope_cos / rope_sin (k = 0), else
        rope_cos_k / rope_sin_k. Non-persistent: derived from the config, never saved, recomputed by
        init_weights()."""
        for k, key in enumerate(self.rope_keys):
            cos_TK, sin_TK = rope_tables(cfg, key)
            self.register_buffer(_rope_name("cos", k), cos_TK, persistent=False)
            self.register_buffer(_rope_name("sin", k), sin_TK, persistent=False)
        self.spans = [(self.rope_keys.index(la.attention.rope_key), la.attention.window) for la in arch.layers]
        self.sinks = arch.sinks
        """Attention sinks in some layer: packed rows' masks are then tensors the eager attention adds."""
        self.rope_after_fp32_norm = any(la.attention.qk_norm is not None and not la.attention.qk_norm.offset
                                        for la in arch.layers)
        """QK-norm whose gain multiplies after the cast back (RMSNorm), so queries and keys reach RoPE in the
        parameters' dtype, not autocast's: packed rows' tables are cast to that (once, not per layer)."""
        """Each layer's (RoPE table index, sliding window: 0 none), read once here rather than in each forward."""
        self.aux_loss = torch.zeros(())
        self.project_logits = True
        """False: forward returns the final norm's output and the loss projects it chunk by chunk
        (memory.chunked_loss, train/loss.py), so the whole logits never exist."""
        self.sequence = WholeSequence()
        """Which positions this rank's tokens are (context parallelism: not the first T)."""
        self.input_shards = 1
        """How many ranks share the positions of the input: tp for a pipeline stage that takes hidden
        states sharded along the sequence (sequence parallelism), else 1."""

    def forward(self, tokens_BT: torch.Tensor, documents_BT: torch.Tensor | None = None) -> torch.Tensor:
        """`documents_BT`: packed rows' document ids (train/packing.py): each sample's positions start at 0
        and its attention keeps to it (models/document_attention.py); None: each row one sequence."""
        if self.tok_embeddings is not None:
            h_BTD = self.tok_embeddings(tokens_BT)
            if self.embedding_scale is not None:  # rounded to the embeddings' dtype first, as Gemma's
                h_BTD = h_BTD * torch.tensor(self.embedding_scale, dtype=h_BTD.dtype, device=h_BTD.device)
        else:
            h_BTD = tokens_BT
        windows = {w for _, w in self.spans}
        if documents_BT is None:
            # The input's T, not h_BTD's: under sequence parallelism that holds 1/tp of the positions.
            rows = self.sequence.rows(tokens_BT.shape[1] * self.input_shards)
            tables = [(getattr(self, _rope_name("cos", k))[rows], getattr(self, _rope_name("sin", k))[rows])
                      for k in range(len(self.rope_keys))]
            seq_len = tables[0][0].shape[0]
            masks = {w: window_mask(seq_len, w, h_BTD) for w in windows}  # one per window
        else:  # [B, 1, T, K] tables (each row's positions), cast once to the queries' dtype as the masks are
            pos_B1T = document_positions(documents_BT)[:, None]
            dtype = _queries_dtype(h_BTD)
            if self.rope_after_fp32_norm:  # RoPE's inputs: the norm's output, promoted by its gain
                dtype = torch.promote_types(dtype, h_BTD.dtype)
            tables = [(getattr(self, _rope_name("cos", k))[pos_B1T].to(dtype),
                       getattr(self, _rope_name("sin", k))[pos_B1T].to(dtype)) for k in range(len(self.rope_keys))]
            masks = document_masks(documents_BT, windows, h_BTD, eager=self.sinks)
        for i, block in self.layers.indexed():
            table, window = self.spans[i]
            h_BTD = block(h_BTD, *tables[table], masks[window])
        self.aux_loss = collect_aux_loss(self.layers, h_BTD.device)
        return output_head(self, h_BTD)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter this rank holds from `seed` (models/init.py: the same values on every
        layout) and rebuild the RoPE tables."""
        init_parameters(self, seed=seed, num_layers=self.cfg.num_layers)
        for k, key in enumerate(self.rope_keys):
            cos = getattr(self, _rope_name("cos", k))
            cos_TK, sin_TK = rope_tables(self.cfg, key, device=cos.device)
            cos.copy_(cos_TK)
            getattr(self, _rope_name("sin", k)).copy_(sin_TK)


def _queries_dtype(like: torch.Tensor) -> torch.dtype:
    """The dtype the attention's queries have: autocast's, else `like`'s."""
    device = like.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else like.dtype


def _rope_name(table: str, k: int) -> str:
    """The buffer of the k-th RoPE setting's cos or sin table (Transformer.rope_keys)."""
    return f"rope_{table}" if k == 0 else f"rope_{table}_{k}"


def collect_aux_loss(layers: LayerStack, device: torch.device) -> torch.Tensor:
    """Sum of the per-layer MoE auxiliary losses of the last forward (zero when there is none)."""
    total = torch.zeros((), device=device)
    for block in layers:
        layer_aux = getattr(block.feed_forward, "aux_loss", None)
        if layer_aux is not None:
            total = total + layer_aux
    return total
