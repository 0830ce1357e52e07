"""GPT-2: learned positions, LayerNorm with bias, GELU (tanh) MLP, biases everywhere, tied output.

Names mirror llama.py so one tensor-parallel plan and one checkpointing policy fit both families:
`tok_embeddings` (HF wte), `pos_embeddings` (wpe), `layers.{i}.attention_norm` (ln_1),
`layers.{i}.attention.{wq,wk,wv}` (HF's fused c_attn, split), `layers.{i}.attention.wo` (attn.c_proj),
`layers.{i}.ffn_norm` (ln_2), `layers.{i}.feed_forward.{w1,w2}` (mlp.c_fc, mlp.c_proj), `norm` (ln_f),
`output` (lm_head, the same Parameter as tok_embeddings.weight when tied). No dropout.

Shape suffixes: B batch, T sequence, D model dim, H heads, K head dim, F feed-forward hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainfit.config.schema import ModelConfig
from trainfit.models.common import LayerStack, WholeSequence, output_head
from trainfit.models.document_attention import document_masks, document_positions
from trainfit.models.init import init_parameters


class Attention(nn.Module):
    """Causal multi-head attention through SDPA; heads read from shapes (tensor-parallel friendly)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.num_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)
        self.sequence = WholeSequence()
        """Causal attention over the whole sequence; context parallelism swaps in its own."""

    def forward(self, x_BTD: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTK, k_BHTK, v_BHTK = (
            proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv)
        )
        o_BHTK = self.sequence.attention(q_BHTK, k_BHTK, v_BHTK, mask)
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x_BTD), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm block, callable as block(x_BTD) or block(x_BTD, mask) (packed samples: their document mask,
    models/document_attention.py); positional tensors only, checkpoint-friendly."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x_BTD: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), mask)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class GPT2(nn.Module):
    """forward(tokens_BT) -> logits_BTV; `aux_loss` is always a 0-dim zero (no MoE in this family).

    As in llama.Transformer, a pipeline split may set `tok_embeddings`/`pos_embeddings` or
    `norm`/`output` to None: the stage then takes or returns hidden states.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = LayerStack([Block(cfg) for _ in range(cfg.num_layers)])
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.aux_loss = torch.zeros(())
        self.project_logits = True
        """False: forward returns the final norm's output and the loss projects it chunk by chunk
        (memory.chunked_loss, train/loss.py), so the whole logits never exist."""
        self.sequence = WholeSequence()
        """Which positions this rank's tokens are (context parallelism: not the first T)."""

    def forward(self, tokens_BT: torch.Tensor, documents_BT: torch.Tensor | None = None) -> torch.Tensor:
        """`documents_BT`: packed rows' document ids, as llama.Transformer's."""
        if self.tok_embeddings is not None:
            if documents_BT is None:
                positions = torch.arange(self.cfg.max_seq_len, device=tokens_BT.device)
                pos = positions[self.sequence.rows(tokens_BT.shape[1])]
            else:
                pos = document_positions(documents_BT)
            h_BTD = self.tok_embeddings(tokens_BT) + self.pos_embeddings(pos)
        else:
            h_BTD = tokens_BT
        mask = None if documents_BT is None else document_masks(documents_BT, {0}, h_BTD)[0]
        for block in self.layers:
            h_BTD = block(h_BTD) if mask is None else block(h_BTD, mask)
        self.aux_loss = torch.zeros((), device=h_BTD.device)
        return output_head(self, h_BTD)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter this rank holds from `seed` (models/init.py)."""
        init_parameters(self, seed=seed, num_layers=self.cfg.num_layers)
