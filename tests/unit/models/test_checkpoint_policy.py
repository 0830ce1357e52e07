"""models/checkpoint_policy.py's description of what each policy keeps agrees with what
trainfit.recompute keeps in a real block's forward, and with its closed forms of the MoE parity."""

from __future__ import annotations

import pytest
import torch

from _runs import seeded_model
from trainfit import recompute
from trainfit.configure import load_config
from trainfit.models.checkpoint_policy import (
    POLICIES,
    kept_linear_shares,
    matmul_order,
    odd_expert_share,
    shared_experts_first_matmul,
)

MODELS = {
    "llama": ["--model.preset=debug"],
    "gpt2": ["--model.preset=debug-gpt2"],
    "moe": ["--model.preset=debug-moe", "--model.num_experts=3", "--model.num_shared_experts=1"],
    "moe-capacity": ["--model.preset=debug-moe", "--model.num_shared_experts=1", "--model.capacity_factor=1.25"],
}


def _first_block_decisions(overrides: list[str], policy: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list, object]:
    """(op kind, kept, op) of every operator of block 0's forward as recompute decides, and the model config."""
    runs: list[list[tuple]] = []
    make = recompute.create_selective_checkpoint_contexts

    def recording(decide):
        run: list[tuple] = []
        runs.append(run)

        def wrapped(ctx, op, *args, **kwargs):
            decision = decide(ctx, op, *args, **kwargs)
            if not ctx.is_recompute:
                run.append((recompute.op_kind(op), decision == recompute.TorchCheckpointPolicy.MUST_SAVE, op))
            return decision

        return make(wrapped)

    monkeypatch.setattr(recompute, "create_selective_checkpoint_contexts", recording)
    cfg = load_config(None, [*overrides, "--training.seq_len=16"])
    model = seeded_model(cfg.model)
    recompute.apply_activation_checkpointing(model, policy)
    model(torch.randint(0, cfg.model.vocab_size, (2, 16)))
    return runs[0], cfg.model


@pytest.mark.parametrize("policy", ["selective", "selective-alternate"])
@pytest.mark.parametrize("name", list(MODELS))
def test_recompute_keeps_what_the_description_says(name: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    decisions, m = _first_block_decisions(MODELS[name], policy, monkeypatch)
    keeps = POLICIES[policy]
    matmuls = [kept for kind, kept, _ in decisions if kind == "matmul"]
    order = matmul_order(m, m.num_experts, bool(m.capacity_factor))
    assert len(matmuls) == len(order), [op for _, _, op in decisions]
    assert matmuls == [keeps.keeps("matmul", i) for i in range(1, len(order) + 1)]
    # Per linear: the share the memory estimate reads.
    shares: dict[str, list[bool]] = {}
    for (linear, _), kept in zip(order, matmuls, strict=True):
        shares.setdefault(linear, []).append(kept)
    assert {k: sum(v) / len(v) for k, v in shares.items()} == kept_linear_shares(m, policy, m.num_experts,
                                                                                  bool(m.capacity_factor))
    # Every other operator: kept exactly when its kind is (the fused attention kernel: kept).
    others = [(kind, kept) for kind, kept, _ in decisions if kind != "matmul"]
    assert ("fused_attention", True) in others
    assert all(kept == keeps.keeps(kind) for kind, kept in others)
    assert not any(kept for kind, kept in others if kind == "other")


def test_full_and_none_keep_no_output_inside_a_block() -> None:
    assert not POLICIES["full"].saves and POLICIES["full"].wraps
    assert not POLICIES["none"].wraps
    m = load_config(None, ["--model.preset=debug"]).model
    assert set(kept_linear_shares(m, "full").values()) == {0.0}


@pytest.mark.parametrize("local_experts", [1, 2, 3, 6])
@pytest.mark.parametrize("capacity", [False, True])
def test_moe_parity_closed_forms_follow_the_matmul_order(local_experts: int, capacity: bool) -> None:
    m = load_config(None, ["--model.preset=debug-moe", "--model.num_experts=6", "--model.num_shared_experts=1"]).model
    order = [name for name, _ in matmul_order(m, local_experts, capacity)]
    assert order.index("shared_w1") + 1 == shared_experts_first_matmul(local_experts, capacity)
    if not capacity:
        shares = kept_linear_shares(m, "selective-alternate", local_experts, capacity)
        assert shares["experts_w1"] == shares["experts_w2"] == odd_expert_share(local_experts)
