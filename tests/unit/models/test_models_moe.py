"""MoE feed-forward: routing parity with transformers' Mixtral, aux loss, gradients, determinism,
capacity-factor dispatch and the routing sizes the estimators use."""

from __future__ import annotations

import math

import pytest
import torch

from _runs import seeded_model
from trainfit.config import ModelConfig
from trainfit.models.moe import MoE, dispatch_slots, load_balancing_loss
from trainfit.models.presets import resolve_model_config
from trainfit.models.routing import dropless_loads, expert_capacity, expert_parallel_loads


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


# ---------------------------------------------------------------- capacity factor and routing sizes


def _moe(capacity_factor: float, **fields: int) -> MoE:
    cfg = resolve_model_config(ModelConfig(preset="debug-moe", capacity_factor=capacity_factor, **fields))
    moe = MoE(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return moe


def test_an_ample_capacity_routes_like_dropless() -> None:
    """capacity_factor >= experts / top_k keeps every pair: the batched path equals the loop."""
    moe = _moe(2.0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    with_capacity = moe(x)
    moe.eval()  # outside training the experts are always dropless
    torch.testing.assert_close(with_capacity, moe(x))


def test_dispatch_keeps_first_choices_first_then_by_position() -> None:
    experts = torch.tensor([[0, 1], [0, 2], [0, 1]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    token_S, weight_S = dispatch_slots(experts, weights, num_experts=3, capacity=2)
    # expert 0 keeps tokens 0 and 1 (token 2's first choice is dropped); expert 1 takes the second
    # choices of tokens 0 and 2; expert 2 the second choice of token 1 and one empty slot.
    assert token_S.tolist() == [0, 1, 0, 2, 1, 0]
    assert weight_S.tolist() == pytest.approx([0.6, 0.7, 0.4, 0.5, 0.3, 0.0])


def test_dropped_tokens_keep_only_the_residual_and_gradients_flow() -> None:
    moe = _moe(0.5, num_shared_experts=0, experts_per_token=1)
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = moe(x)[0]
    capacity = expert_capacity(16, 1, 4, 0.5)
    assert capacity == 2
    routed = (out.abs().sum(-1) > 0).sum().item()
    assert routed <= 4 * capacity  # the others got no expert output at all
    out.sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0 and moe.experts.w1.grad.abs().sum() > 0
    assert torch.equal(moe(x), moe(x))


def test_dropless_loads_put_the_busiest_third_from_last() -> None:
    assert dropless_loads(1024, 1, 4, 1.0) == [256, 256, 256, 256]
    assert dropless_loads(1024, 1, 16, 6.0) == [50] * 3 + [49] * 10 + [384, 0, 0]
    assert dropless_loads(1024, 2, 4, math.inf) == [1024, 1024, 0, 0]  # the ceiling: every token
    for args in [(1000, 2, 8, 2.5), (7, 1, 3, 1.0), (64, 2, 2, math.inf), (10, 1, 1, 3.0)]:
        loads = dropless_loads(*args)
        assert sum(loads) == args[0] * args[1] and max(loads) <= args[0]


def test_expert_parallel_loads_are_the_busiest_ranks() -> None:
    """Every rank routes as dropless_loads; the busiest rank holds the experts loaded most and
    receives their rows from every rank of its group."""
    assert expert_parallel_loads(1024, 2, 4, 1, 1.3) == dropless_loads(1024, 2, 4, 1.3)  # one rank: as before
    assert expert_parallel_loads(1024, 2, 4, 2, 1.0) == [1024, 1024]  # balanced: its own pairs' worth
    assert expert_parallel_loads(1024, 2, 4, 2, 1.3) == [1332, 1332]  # busiest 666 of 2048 pairs, and its peer
    assert expert_parallel_loads(1024, 2, 4, 2, math.inf) == [2048, 2048]  # the ceiling: both ranks' every pair
    assert sum(expert_parallel_loads(1024, 1, 16, 4, 6.0)) == 4 * (384 + 3 * 50)  # the heaviest 4 of 16
