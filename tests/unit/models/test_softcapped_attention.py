"""Soft-capped attention (Gemma 2; models/softcapped_attention.py): FlexAttention's form, checked on CPU
forward-only (its backward is CUDA's) against the eager form, and what each form keeps for backward."""

from __future__ import annotations

import pytest
import torch

from trainfit.models.architecture import softcap_kernel
from trainfit.models.common import window_mask
from trainfit.models.softcapped_attention import (
    eager_softcapped_attention,
    flex_softcapped_attention,
    softcapped_attention,
    traced_as,
)

B, H, G, T, K = 2, 4, 2, 32, 16


def _qkv(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (3 * torch.randn(B, heads, T, K, generator=gen) for heads in (H, G, G))
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [0, 8])
def test_flex_attention_with_the_cap_as_score_mod_is_the_eager_form(window: int) -> None:
    q, k, v = _qkv()
    eager = eager_softcapped_attention(q, k, v, window_mask(T, window, q), 0.3, 5.0)
    flex = flex_softcapped_attention(q, k, v, 0.3, 5.0, window, compiled=False)
    torch.testing.assert_close(flex, eager, atol=1e-5, rtol=1e-5)
    uncapped = eager_softcapped_attention(q, k, v, window_mask(T, window, q), 0.3, 1e6)
    assert (uncapped - eager).abs().max() > 1e-2  # the cap bends these scores: the check compares something


def _largest_saved(device_type: str | None) -> int:
    q, k, v = _qkv(requires_grad=True)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if device_type is None:
            softcapped_attention(q, k, v, None, 0.3, 5.0)
        else:
            with traced_as(device_type):
                softcapped_attention(q, k, v, None, 0.3, 5.0)
    return max(sizes)


def test_the_eager_form_keeps_scores_and_a_traced_cuda_step_keeps_flex_attentions_tensors_only() -> None:
    assert softcap_kernel("cpu") == "eager" and softcap_kernel("cuda") == "flex"
    assert _largest_saved(None) == B * H * T * T  # on CPU: the eager form's [heads, queries, keys]
    assert _largest_saved("cpu") == B * H * T * T
    assert _largest_saved("cuda") == B * H * T * K  # FlexAttention keeps q, k, v, the output, a logsumexp
