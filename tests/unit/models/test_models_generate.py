"""generate(): greedy determinism, length, context cropping, seeded sampling."""

from __future__ import annotations

import pytest
import torch

from trainfit.config import ModelConfig
from trainfit.models import build_model, materialize
from trainfit.models.generate import generate


@pytest.fixture(params=["debug", "debug-gpt2"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    m = materialize(build_model(ModelConfig(preset=request.param, max_seq_len=32)), "cpu")
    with torch.no_grad():  # sharper distributions than the 0.02 init, so tokens differ between steps
        m.output.weight.mul_(50)
    return m


def test_greedy_is_deterministic_and_follows_the_argmax(model: torch.nn.Module) -> None:
    prompt = [1, 2, 3]
    out = generate(model, prompt, max_new_tokens=5, temperature=0)
    assert out == generate(model, prompt, max_new_tokens=5, temperature=0)
    assert len(out) == 8 and out[:3] == prompt
    with torch.no_grad():
        for i in range(3, 8):
            assert out[i] == int(model(torch.tensor([out[:i]]))[0, -1].argmax())


def test_long_prompt_is_cropped_to_max_seq_len(model: torch.nn.Module) -> None:
    prompt = list(range(40))  # longer than max_seq_len=32: would fail without cropping
    out = generate(model, prompt, max_new_tokens=3, temperature=0)
    assert len(out) == 43
    assert out[40] == int(model(torch.tensor([prompt[-32:]]))[0, -1].argmax())


def test_sampling_is_reproducible_with_a_generator(model: torch.nn.Module) -> None:
    def sample(seed: int, **kwargs: object) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, [5], max_new_tokens=20, temperature=100.0, generator=gen, **kwargs)

    assert sample(1) == sample(1)
    assert sample(1, top_k=None) != sample(2, top_k=None)
    assert sample(1, top_k=1) == generate(model, [5], max_new_tokens=20, temperature=0)


def test_rejects_empty_prompt(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="prompt_tokens is empty"):
        generate(model, [], max_new_tokens=1)
