"""Attention with soft-capped scores (Gemma 2): each score s becomes c tanh(s / c) before the mask and the
softmax, which no SDPA kernel expresses. On CUDA it runs FlexAttention (the cap a score_mod, the causal
window a block mask whose empty blocks are skipped; compiled, as FlexAttention needs to be fused); elsewhere
(torch 2.13's FlexAttention has no backward on CPU) an eager attention written out op by op in
transformers' order (models/architecture.softcap_kernel decides, for the model and the estimators)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from trainfit.models.architecture import softcap_kernel
from trainfit.models.eager_attention import eager_attention

_TRACED_DEVICE: ContextVar[str | None] = ContextVar("traced_device", default=None)


def traced_device() -> str | None:
    """The device a traced estimate stands for (traced_as), None outside one."""
    return _TRACED_DEVICE.get()


@contextlib.contextmanager
def traced_as(device_type: str) -> Iterator[None]:
    """Within it, the attention is traced (on fake CPU tensors: trainfit.traced) for a run on `device_type`:
    FlexAttention's run is stood in for by SDPA's fused kernel, which keeps what it keeps (q, k, v, the
    output and a logsumexp); the numbers do not matter there, the tensors do."""
    token = _TRACED_DEVICE.set(device_type)
    try:
        yield
    finally:
        _TRACED_DEVICE.reset(token)


def softcapped_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                         window_TT: torch.Tensor | None, scale: float | None, softcap: float, window: int = 0
                         ) -> torch.Tensor:
    """Causal attention whose scores are soft-capped at `softcap`; `window_TT`: the layer's sliding-window
    mask (common.window_mask's) for the eager form, `window` its size for FlexAttention's block mask."""
    traced = _TRACED_DEVICE.get()
    if softcap_kernel(traced or q_BHTK.device.type) == "flex":
        if traced is not None:  # FlexAttention's footprint (traced_as)
            return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=window_TT,
                                                  is_causal=window_TT is None, scale=scale,
                                                  enable_gqa=q_BHTK.shape[1] != k_BGTK.shape[1])
        return flex_softcapped_attention(q_BHTK, k_BGTK, v_BGTK, scale, softcap, window)
    return eager_softcapped_attention(q_BHTK, k_BGTK, v_BGTK, window_TT, scale, softcap)


def eager_softcapped_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                               window_TT: torch.Tensor | None, scale: float | None, softcap: float) -> torch.Tensor:
    """The eager form (models/eager_attention.py)."""
    return eager_attention(q_BHTK, k_BGTK, v_BGTK, window_TT, scale, softcap)


def flex_softcapped_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor,
                              scale: float | None, softcap: float, window: int, compiled: bool = True
                              ) -> torch.Tensor:
    """FlexAttention: the cap as its score_mod, causality and the window as its block mask. It keeps what a
    fused kernel keeps (q, k, v, the output and a logsumexp). `compiled` False runs torch's unfused
    reference (forward only on CPU: how the tests check it against the eager form)."""
    from torch.nn.attention.flex_attention import flex_attention

    T = q_BHTK.shape[2]
    attend = compiled_flex_attention() if compiled else flex_attention
    return attend(q_BHTK, k_BGTK, v_BGTK, score_mod=capped_scores(softcap), scale=scale,
                  block_mask=_block_mask(T, window, str(q_BHTK.device)),
                  enable_gqa=q_BHTK.shape[1] != k_BGTK.shape[1])


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def capped_scores(softcap: float) -> Callable[..., torch.Tensor]:
    """One function per cap, so that the compiled kernel is reused from layer to layer."""
    def capped(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
               kv_idx: torch.Tensor) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)
    return capped


@functools.lru_cache(maxsize=16)
def _block_mask(seq_len: int, window: int, device: str) -> object:
    """Causal, within `window` positions (0: all earlier ones), built once per length, window and device."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        causal = q_idx >= kv_idx
        return causal & (q_idx - kv_idx < window) if window else causal
    return create_block_mask(allowed, None, None, seq_len, seq_len, device=device)
