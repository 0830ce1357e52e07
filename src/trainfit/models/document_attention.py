"""Attention that keeps to each sample of a packed row (data.packing, train/packing.py): a query attends the
keys of its own sample only, causally, within its layer's window. The rows' document ids [B, T] say which
sample each position holds; the mask is built from them once per forward and shared by the layers of one
window. On CUDA it is a FlexAttention block mask (blocks no sample spans are skipped, so attention costs what
the samples' lengths say, not the row's); elsewhere an explicit additive mask for SDPA (document_mask).
architecture.document_mask_kernel decides which, for the model and the estimators."""

from __future__ import annotations

from typing import Any

import torch

from trainfit.models.architecture import document_mask_kernel
from trainfit.models.softcapped_attention import capped_scores, compiled_flex_attention, traced_device


def document_masks(documents_BT: torch.Tensor, windows: set[int], like: torch.Tensor, eager: bool = False
                   ) -> dict[int, Any]:
    """Each window's mask of the rows (0: causal within the sample): a FlexAttention BlockMask where the
    kernel is flex; under a traced estimate of such a run None, so that SDPA's causal kernel stands in for
    FlexAttention's fused one (what it keeps); else (and for the eager attention of sinks, `eager`) the
    additive [B, 1, T, T] tensor."""
    device_type = traced_device() or documents_BT.device.type
    if document_mask_kernel(device_type, sinks=eager) == "flex":
        if traced_device() is not None:
            return dict.fromkeys(windows)
        return {w: document_block_mask(documents_BT, w) for w in windows}
    return {w: document_mask(documents_BT, w, like) for w in windows}


def document_block_mask(documents_BT: torch.Tensor, window: int) -> Any:
    """FlexAttention's block mask of packed rows: same document, causal, within `window` (0: no window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = documents_BT.shape

    def allowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = (q_idx >= kv_idx) & (documents_BT[b, q_idx] == documents_BT[b, kv_idx])
        return keep & (q_idx - kv_idx < window) if window else keep
    return create_block_mask(allowed, B, None, T, T, device=str(documents_BT.device))


def is_block_mask(mask: object) -> bool:
    """Whether `mask` is FlexAttention's (document_block_mask's) rather than an SDPA mask tensor or None."""
    return mask is not None and not isinstance(mask, torch.Tensor)


def flex_document_attention(q_BHTK: torch.Tensor, k_BGTK: torch.Tensor, v_BGTK: torch.Tensor, block_mask: Any,
                            scale: float | None, softcap: float = 0.0, compiled: bool = True) -> torch.Tensor:
    """FlexAttention under a document block mask, its scores soft-capped when `softcap`. `compiled` False runs
    torch's unfused reference (forward only on CPU: how the tests check it against the SDPA form)."""
    from torch.nn.attention.flex_attention import flex_attention

    attend = compiled_flex_attention() if compiled else flex_attention
    return attend(q_BHTK, k_BGTK, v_BGTK, score_mod=capped_scores(softcap) if softcap else None, scale=scale,
                  block_mask=block_mask, enable_gqa=q_BHTK.shape[1] != k_BGTK.shape[1])


def document_positions(documents_BT: torch.Tensor) -> torch.Tensor:
    """Each position's offset within its sample of a packed row [B, T] (train/packing.py): positions restart
    where the document id changes, as each sample's would start at 0 in a row of its own."""
    T = documents_BT.shape[1]
    pos_T = torch.arange(T, device=documents_BT.device)
    starts_BT = torch.ones_like(documents_BT, dtype=torch.bool)
    starts_BT[:, 1:] = documents_BT[:, 1:] != documents_BT[:, :-1]
    first_BT = torch.where(starts_BT, pos_T, 0).cummax(dim=1).values
    return pos_T - first_BT


def document_mask(documents_BT: torch.Tensor, window: int, like: torch.Tensor) -> torch.Tensor:
    """Packed rows' additive mask [B, 1, T, T] (0 or -inf): query i attends key j of its own sample only,
    causally, within `window` (0: all earlier ones). As window_mask: built once per forward in the queries'
    dtype, so the layers of one window share (and save) one tensor."""
    T, device = documents_BT.shape[1], like.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else like.dtype
    pos_T = torch.arange(T, device=device)
    offset_TT = pos_T[:, None] - pos_T[None, :]
    hidden_TT = (offset_TT < 0) | (offset_TT >= window) if window else offset_TT < 0
    hidden_BTT = hidden_TT | (documents_BT[:, :, None] != documents_BT[:, None, :])
    return torch.zeros(hidden_BTT.shape, dtype=dtype, device=device).masked_fill_(hidden_BTT, float("-inf"))[:, None]
