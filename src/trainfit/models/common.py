"""Parts both model families and the MoE share: the SwiGLU MLP, the output head and the sequence
layout (the weight init is models/init.py).

Here so that llama.py imports moe.py and gpt2.py imports nothing of llama.py: one direction only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainfit.models.document_attention import flex_document_attention, is_block_mask
from trainfit.models.eager_attention import eager_attention
from trainfit.models.softcapped_attention import softcapped_attention


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x), SwiGLU with silu, GeGLU with tanh-GELU (Gemma); w1 is the gate,
    w3 the up projection, w2 the down one."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.gelu = activation == "gelu_tanh"

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        # one expression, no locals: each temporary is freed as soon as its consumer has run
        return self.w2(self._activate(self.w1(x_BTD)) * self.w3(x_BTD))

    def _activate(self, gate_BTF: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate_BTF, approximate="tanh") if self.gelu else F.silu(gate_BTF)


def output_head(model: nn.Module, h_BTD: torch.Tensor) -> torch.Tensor:
    """Final norm and output projection, each skipped when a pipeline stage has none; the projection
    also when the loss applies it itself (`model.project_logits` False: memory.chunked_loss)."""
    if model.norm is not None:
        h_BTD = model.norm(h_BTD)
    if model.output is None or not model.project_logits:
        return h_BTD
    return softcapped(model.output(h_BTD), getattr(model, "final_softcap", 0.0))


def softcapped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap x tanh(logits / softcap) (Gemma 2's final logits, in transformers' order); as is when 0."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


class LayerStack(nn.ModuleDict):
    """The transformer blocks under their global indices ("layers.7" whatever the stage): a pipeline
    stage keeps some of them and drops the rest, and its parameter names, weight init and
    checkpoint keys stay those of the whole model. Iterates over the blocks, in order, like the
    nn.ModuleList it replaces; `stack[i]` is block i."""

    def __init__(self, blocks: list[nn.Module] | dict[int, nn.Module]) -> None:
        """`blocks`: all of them (indices 0, 1, ...), or some under their global indices."""
        indexed = blocks.items() if isinstance(blocks, dict) else enumerate(blocks)
        super().__init__({str(i): block for i, block in indexed})

    def __iter__(self):  # type: ignore[override]
        return iter(self.values())

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def __setitem__(self, index: int | str, block: nn.Module) -> None:
        super().__setitem__(str(index), block)

    def indexed(self) -> list[tuple[int, nn.Module]]:
        """(global layer index, block) pairs, in order."""
        return [(int(key), block) for key, block in self.items()]

    def keep(self, indices: range) -> None:
        """Drop every block whose global index is outside `indices` (a pipeline stage's)."""
        for key in [k for k in self.keys() if int(k) not in indices]:
            del self[key]


class WholeSequence:
    """How a rank's tokens sit in the sequence, for the attention and the positions: here, the
    whole sequence in order (one rank, or tensor parallelism). Context parallelism replaces it on
    the model and every attention (parallel/context_parallel.py's ContextParallel)."""

    backends: list[SDPBackend] | None = None
    """The SDPA kernels the attention may use (training.attention_backend, set by trainfit.attention);
    None lets torch choose. Applied around each SDPA call, not around the step: the call is where
    torch picks the kernel (the recompute of a checkpointed block calls it again, inside backward),
    and the backward of a fused kernel is its own node, fixed by the forward's choice."""

    def kernel(self) -> contextlib.AbstractContextManager[object]:
        """The context an SDPA call of this layout runs in: the chosen backends, or torch's choice."""
        return sdpa_kernel(self.backends) if self.backends is not None else contextlib.nullcontext()

    def shard(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a [B, T] batch (all of them)."""
        return tokens_BT

    def rows(self, local_len: int) -> slice | torch.Tensor:
        """The positions of this rank's `local_len` tokens: rows of a position table."""
        return slice(0, local_len)

    def attention(self, q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                  window_TT: torch.Tensor | None = None, scale: float | None = None, softcap: float = 0.0,
                  window: int = 0, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the queries over the keys and values (grouped-query when G < H); with
        `window_TT` (window_mask's of the layer's `window`), over the keys it allows only; `scale`: the dot
        products' factor (None: 1 / sqrt(head_dim)); `softcap`: soft-capped scores
        (models/softcapped_attention.py); `sinks_H`: attention sinks (models/eager_attention.py); else SDPA."""
        if sinks_H is not None:
            return eager_attention(q_BHTK, k_BGTK, v_BGTK, window_TT, scale, softcap, sinks_H)
        if is_block_mask(window_TT):  # packed samples on CUDA (models/document_attention.py)
            return flex_document_attention(q_BHTK, k_BGTK, v_BGTK, window_TT, scale, softcap)
        if softcap:
            return softcapped_attention(q_BHTK, k_BGTK, v_BGTK, window_TT, scale, softcap, window)
        with self.kernel():
            return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=window_TT,
                                                  is_causal=window_TT is None, scale=scale,
                                                  enable_gqa=q_BHTK.shape[1] != k_BGTK.shape[1])


def window_mask(seq_len: int, window: int, like: torch.Tensor) -> torch.Tensor | None:
    """A sliding window's additive mask [T, T] (0 or -inf): query i attends keys i - window < j <= i
    (Mistral's and transformers' convention: the window counts the query itself); None when the window
    spans the whole sequence (plain causal attention, the same result). SDPA takes it as an explicit
    mask (on CPU its flash kernel; on CUDA a kernel that takes masks). Built once per forward in the
    dtype the attention's queries have (autocast's, else `like`'s), so every layer's SDPA saves this
    one tensor: a boolean mask, or another dtype, would be converted, and saved, once per layer."""
    if not window or window >= seq_len:
        return None
    device = like.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else like.dtype
    pos_T = torch.arange(seq_len, device=device)
    offset_TT = pos_T[:, None] - pos_T[None, :]
    hidden_TT = (offset_TT < 0) | (offset_TT >= window)
    return torch.zeros(seq_len, seq_len, dtype=dtype, device=device).masked_fill_(hidden_TT, float("-inf"))


def set_sequence_layout(model: nn.Module, layout: WholeSequence) -> None:
    """Give `model` and each of its attention modules `layout` (they read it as `.sequence`)."""
    for module in model.modules():
        if hasattr(module, "sequence"):
            module.sequence = layout
