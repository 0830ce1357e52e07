"""Llama and GPT-2 model contracts: meta build, shapes, causality, deterministic init, block API."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from _runs import seeded_model
from trainfit.config import ModelConfig
from trainfit.models import build_model
from trainfit.models.llama import Transformer

PRESETS = ["debug", "debug-moe", "debug-gpt2"]


def tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_build_model_is_on_meta_and_dispatches_on_family() -> None:
    llama, gpt2 = build_model(ModelConfig(preset="debug")), build_model(ModelConfig(preset="debug-gpt2"))
    assert isinstance(llama, Transformer) and type(gpt2).__name__ == "GPT2"
    assert all(p.is_meta for p in [*llama.parameters(), *gpt2.parameters()])
    names = dict(llama.named_parameters())
    for suffix in ("attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo",
                   "ffn_norm", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
        assert f"layers.1.{suffix}.weight" in names
    assert names["layers.0.attention.wk.weight"].shape == (2 * 16, 64)  # GQA: 2 kv heads of 16


@pytest.mark.parametrize("preset", PRESETS)
def test_forward_shape_dtype_and_aux_loss(preset: str) -> None:
    model = seeded_model(ModelConfig(preset=preset))
    logits = model(tokens())
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert model.aux_loss.shape == () and torch.isfinite(model.aux_loss)
    assert (model.aux_loss > 0) == (preset == "debug-moe")


@pytest.mark.parametrize("preset", PRESETS)
def test_causal_future_tokens_do_not_change_earlier_logits(preset: str) -> None:
    model = seeded_model(ModelConfig(preset=preset))
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-6, rtol=0)
    assert (a[:, 10:] - b[:, 10:]).abs().max() > 1e-4


@pytest.mark.parametrize("preset", PRESETS)
def test_init_is_deterministic_per_seed(preset: str) -> None:
    a, b, c = (seeded_model(ModelConfig(preset=preset), seed) for seed in (3, 3, 4))
    triples = zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True)
    for (name, pa), pb, pc in triples:
        assert torch.equal(pa, pb), name
        if pa.std() > 0:
            assert not torch.equal(pa, pc), name


def test_init_values_norms_biases_and_residual_scaling() -> None:
    model = seeded_model(ModelConfig(preset="debug-gpt2", dim=256, ffn_dim=1024, num_layers=8))
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.0.attention_norm.weight"], torch.ones(256))
    assert torch.equal(params["layers.0.attention.wq.bias"], torch.zeros(256))
    assert params["layers.0.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert params["layers.3.attention.wo.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert params["layers.3.feed_forward.w2.weight"].std().item() == pytest.approx(residual_std, rel=0.05)


@pytest.mark.parametrize("preset", ["debug", "debug-gpt2"])
def test_tied_embeddings_survive_materialization(preset: str) -> None:
    model = seeded_model(ModelConfig(preset=preset, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_rope_tables_are_recomputed_and_not_saved() -> None:
    model = seeded_model(ModelConfig(preset="debug"))
    assert not any("rope" in k for k in model.state_dict())
    assert torch.equal(model.rope_cos[0], torch.ones(16))
    # position 1, first frequency pair: angle 1 rad
    assert model.rope_sin[1, 0].item() == pytest.approx(math.sin(1.0))


@pytest.mark.parametrize("preset", ["debug", "debug-moe"])
def test_blocks_work_under_activation_checkpointing(preset: str) -> None:
    """recompute.py wraps model.layers[i]; gradients (aux loss included) must be unchanged."""
    model = seeded_model(ModelConfig(preset=preset))
    x = tokens()
    (model(x).square().mean() + model.aux_loss).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for i, block in enumerate(model.layers):
        model.layers[i] = CheckpointedBlock(block)
    (model(x).square().mean() + model.aux_loss).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name.replace("block.", "")], atol=1e-6, rtol=1e-5)


class CheckpointedBlock(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.block, name)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False)
