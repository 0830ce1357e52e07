"""Packed samples' attention (models/document_attention.py): a packed row computes what each of its samples
computes alone (no cross-talk: positions restart, attention keeps to the sample), on every family and with
windows and soft-capped scores; FlexAttention's document block mask (CUDA's form) checked forward-only on CPU."""

from __future__ import annotations

import pytest
import torch

from _runs import seeded_model
from trainfit.config import ModelConfig
from trainfit.models.architecture import document_mask_kernel
from trainfit.models.document_attention import (
    document_block_mask,
    document_mask,
    document_positions,
    flex_document_attention,
)

MODELS = {
    "llama": dict(preset="debug"),
    "gpt2": dict(preset="debug-gpt2"),
    "windowed_softcapped": dict(preset="debug", sliding_window=3, sliding_window_pattern=2, attention_softcap=20.0,
                                final_softcap=10.0),
}
LENGTHS = (5, 1, 7, 3)  # one row of 16: four samples and no padding


def _documents(lengths: tuple[int, ...], pad: int = 0) -> torch.Tensor:
    ids = [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * pad
    return torch.tensor([ids])


@pytest.mark.parametrize("name", MODELS, ids=list(MODELS))
def test_a_packed_row_computes_what_each_sample_computes_alone(name: str) -> None:
    model = seeded_model(ModelConfig(**MODELS[name])).eval()
    tokens = torch.randint(0, 256, (1, sum(LENGTHS) + 2), generator=torch.Generator().manual_seed(0))
    documents = _documents(LENGTHS, pad=2)
    with torch.no_grad():
        packed = model(tokens, documents)
        alone, start = [], 0
        for n in LENGTHS:
            alone.append(model(tokens[:, start:start + n]))
            start += n
        crossed = model(tokens)  # the same row as one sequence: later samples see earlier ones
    torch.testing.assert_close(packed[:, :start], torch.cat(alone, dim=1), atol=1e-5, rtol=1e-5)
    assert (crossed[:, LENGTHS[0]:start] - packed[:, LENGTHS[0]:start]).abs().max() > 1e-3
    assert torch.isfinite(packed).all()  # the padding attends itself: no empty softmax


def test_positions_restart_at_each_sample_and_the_mask_is_block_diagonal_and_causal() -> None:
    documents = _documents((3, 2), pad=1)
    assert document_positions(documents).tolist() == [[0, 1, 2, 0, 1, 0]]
    allowed = document_mask(documents, 0, torch.zeros(1)) == 0
    assert allowed.shape == (1, 1, 6, 6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 3), (3, 5), (5, 6)):
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(allowed[0, 0], expected)
    windowed = document_mask(documents, 2, torch.zeros(1)) == 0
    assert not windowed[0, 0, 2, 0] and windowed[0, 0, 2, 1]


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_flex_attentions_document_block_mask_is_the_sdpa_form(softcap: float) -> None:
    B, H, G, T, K = 2, 4, 2, 32, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, T, K, generator=gen) for heads in (H, G, G))
    documents = torch.cat([_documents((10, 6, 16)), _documents((20, 9), pad=3)])
    from trainfit.models.common import WholeSequence

    expected = WholeSequence().attention(q, k, v, document_mask(documents, 4, q), 0.3, softcap, 4)
    flex = flex_document_attention(q, k, v, document_block_mask(documents, 4), 0.3, softcap, compiled=False)
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=1e-5)
    assert document_mask_kernel("cuda") == "flex" and document_mask_kernel("cpu") == "sdpa"
