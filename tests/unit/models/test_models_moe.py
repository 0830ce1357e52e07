"""MoE feed-forward: routing parity with transformers' Mixtral, aux loss, gradients, determinism."""

from __future__ import annotations

import pytest
import torch

from _runs import seeded_model
from trainfit.config import ModelConfig
from trainfit.models.moe import MoE, load_balancing_loss
from trainfit.models.presets import resolve_model_config


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))


def test_aux_loss_positive_finite_and_trains_the_router() -> None:
    model = seeded_model(ModelConfig(preset="debug-moe"))
    model(tokens())
    assert model.aux_loss.shape == () and torch.isfinite(model.aux_loss) and model.aux_loss > 0
    model.aux_loss.backward()
    for i in range(2):
        grad = model.layers[i].feed_forward.router.weight.grad
        assert grad is not None and grad.abs().sum() > 0
    model.zero_grad()
    model(tokens()).logsumexp(-1).mean().backward()  # the routing weights alone also reach the router
    assert model.layers[0].feed_forward.router.weight.grad.abs().sum() > 0
    assert model.layers[0].feed_forward.experts.w2.grad.abs().sum() > 0


def test_aux_loss_of_a_uniform_router_is_top_k() -> None:
    """Uniform probabilities give P_i = 1/E and sum_i f_i = K, so E * sum f_i P_i = K exactly."""
    probs = torch.full((10, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3]] * 5)
    assert load_balancing_loss(probs, experts).item() == pytest.approx(2.0)
    collapsed = torch.zeros(10, 4)
    collapsed[:, 0] = 1.0
    assert load_balancing_loss(collapsed, torch.zeros(10, 1, dtype=torch.long)).item() == pytest.approx(4.0)


def test_forward_is_deterministic() -> None:
    model = seeded_model(ModelConfig(preset="debug-moe"))
    x = tokens()
    a, b = model(x), model(x)
    assert torch.equal(a, b)


def test_shared_experts_apply_to_every_token() -> None:
    cfg = resolve_model_config(ModelConfig(preset="debug-moe"))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert moe.shared_experts.w1.weight.shape == (cfg.num_shared_experts * cfg.expert_ffn_dim, cfg.dim)
    x = torch.randn(1, 5, cfg.dim)
    with_shared = moe(x)
    expected_shared = moe.shared_experts(x)
    moe.shared_experts = None
    torch.testing.assert_close(with_shared - moe(x), expected_shared)


def test_routing_matches_transformers_mixtral_block() -> None:
    """Same weights -> same outputs as MixtralSparseMoeBlock, and our aux loss equals HF's for one layer."""
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

    cfg = resolve_model_config(ModelConfig(preset="debug-moe", num_shared_experts=0, num_experts=5,
                                           experts_per_token=2))
    torch.manual_seed(0)
    ours = MoE(cfg)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    hf_cfg = MixtralConfig(hidden_size=cfg.dim, intermediate_size=cfg.expert_ffn_dim,
                           num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token)
    theirs = MixtralSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w1, ours.experts.w3], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.w2)
    x = torch.randn(2, 7, cfg.dim)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    router_logits = ours.router(x.reshape(-1, cfg.dim))
    hf_aux = load_balancing_loss_func((router_logits,), cfg.num_experts, cfg.experts_per_token)
    torch.testing.assert_close(ours.aux_loss, hf_aux)
