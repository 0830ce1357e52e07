"""models/block_spec.py is the one description of a block's linears: every real block matches it,
the tensor-parallel plan places each weight as it says, and the time model's GEMMs, per-rank FLOPs
and data-parallel volumes split each layer as it says (an MoE feed-forward whole on the tp ranks)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from _dist import fake_world
from _runs import run_config
from trainfit.config import ModelConfig
from trainfit.configure import load_config
from trainfit.hardware import device_type
from trainfit.models import build_model
from trainfit.models.block_spec import block_linears
from trainfit.models.params import param_counts
from trainfit.parallel.resolve import build_layout
from trainfit.parallel.tensor_parallel import apply_tensor_parallel
from trainfit.perf import comms, kernels, timing

FAMILIES = {
    "llama": ("--model.preset=debug",),
    "llama qkv bias": ("--model.preset=debug", "--model.qkv_bias=true"),
    "gpt2": ("--model.preset=debug-gpt2",),
    "moe": ("--model.preset=debug-moe",),
    "moe with shared experts": ("--model.preset=debug-moe", "--model.num_shared_experts=2"),
}


def _model(*overrides: str) -> ModelConfig:
    return load_config(None, list(overrides)).model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_linear_and_expert_weight_of_a_real_block_is_described(family: str) -> None:
    m = _model(*FAMILIES[family])
    block = build_model(m).layers[0]
    spec = {linear.path: linear for linear in block_linears(m)}
    linears = {name: module for name, module in block.named_modules() if isinstance(module, nn.Linear)}
    experts = {name: p for name, p in block.named_parameters() if name.startswith("feed_forward.experts.")}
    assert set(spec) == set(linears) | set(experts)
    for path, module in linears.items():
        linear = spec[path]
        assert (module.in_features, module.out_features, module.bias is not None) == \
            (linear.in_features, linear.out_features, linear.bias), path
        assert linear.copies == 1 and not linear.routed
    for path, weight in experts.items():
        linear = spec[path]
        assert linear.routed and tuple(weight.shape) == (linear.copies, linear.out_features, linear.in_features)
        assert linear.token_share == m.experts_per_token / m.num_experts
    assert sum(linear.local_params(1) for linear in spec.values()) + param_counts(m).norms == \
        param_counts(m).per_layer


@pytest.mark.parametrize("family", ["llama", "gpt2", "moe with shared experts"])
def test_the_tensor_parallel_plan_places_each_weight_as_described(family: str) -> None:
    m = _model(*FAMILIES[family])
    model = build_model(m)
    with fake_world(2):
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sequence_parallel=True)
        block = model.layers[0]
        for linear in block_linears(m):
            weight = block.get_parameter(f"{linear.path}.weight" if not linear.routed else linear.path)
            if linear.tp == "replicated":
                assert not isinstance(weight, DTensor), linear.path
                continue
            assert isinstance(weight, DTensor), linear.path
            assert weight.placements == (Shard(0 if linear.tp == "column" else 1),), linear.path
            k, n = linear.local_shape(2)
            assert tuple(weight.to_local().shape) == (n, k), linear.path


def test_an_moe_feed_forward_is_priced_whole_on_each_tp_rank(tmp_path) -> None:
    base = ("--model.preset=debug-moe", "--training.micro_batch_size=2", "--training.global_batch_size=0")
    one = run_config(tmp_path, *base)
    two = run_config(tmp_path, *base, "--hardware.num_gpus=2", "--parallel.tp=2")
    m = one.model
    gemms = {g.name: g for g in kernels.block_gemms(m, build_layout(two, 2))}
    assert (gemms["experts_w1"].k, gemms["experts_w1"].n) == (m.dim, m.expert_ffn_dim)  # whole, not / tp
    assert (gemms["router"].k, gemms["router"].n) == (m.dim, m.num_experts)
    assert (gemms["wq"].k, gemms["wq"].n) == (m.dim, m.dim // 2)
    c = param_counts(m)
    block_one, _ = comms.stage_params(m, build_layout(one, 1))
    block_two, _ = comms.stage_params(m, build_layout(two, 2))
    assert block_one == c.per_layer
    assert block_two == c.per_layer - c.attention // 2  # attention halves; the MoE and the norms stay whole
    # Per rank and token, tp=2 halves the attention's matmuls and none of the MoE's.
    flops_one = timing._rank_flops(m, build_layout(one, 1), one.training, device_type(one.hardware))
    flops_two = timing._rank_flops(m, build_layout(two, 2), two.training, device_type(two.hardware))
    tokens = one.training.micro_batch_size * one.training.seq_len  # per rank in both (dp 1)
    local = 2 * sum(g.k * g.n * g.share for g in kernels.block_gemms(m, build_layout(two, 2)))
    whole = 2 * sum(g.k * g.n * g.share for g in kernels.block_gemms(m, build_layout(one, 1)))
    assert whole / 2 < local < whole
    assert flops_two.forward - flops_one.forward / 2 == pytest.approx(m.num_layers * tokens * (local - whole / 2),
                                                                    rel=1e-9)


def test_selective_alternate_counts_the_parity_of_a_ranks_own_experts() -> None:
    """Expert e of a rank runs its matmuls 6 + 3e to 8 + 3e, numbered from the rank's first expert,
    so the parity of what selective-alternate reruns depends on E / ep, not E (6 experts: 3 per rank
    at ep 2). The memory estimate reads the same two facts (memory/closed_form/block/activations.py)."""
    m = _model("--model.preset=debug-moe", "--model.num_experts=6", "--model.num_shared_experts=1")
    from trainfit.models.checkpoint_policy import odd_expert_share, shared_experts_first_matmul
    from trainfit.perf import flops

    assert (odd_expert_share(6), odd_expert_share(3)) == (0.5, 1 / 3)
    assert (shared_experts_first_matmul(6, False), shared_experts_first_matmul(3, False)) == (24, 15)
    head_dim = m.dim // m.num_heads
    attention = m.dim * (m.num_kv_heads + m.num_heads) * head_dim  # wk, wo
    expert = m.dim * m.expert_ffn_dim
    # even-numbered experts rerun w1 and w2 (2 weights), odd ones w3; the shared experts by their parity
    at_ep1 = attention + (m.experts_per_token * (0.5 * 2 + 0.5) + 2) * expert  # shared w1 is the 24th: even
    at_ep2 = attention + (m.experts_per_token * (2 / 3 * 2 + 1 / 3) + 1) * expert  # the 15th: odd
    assert flops.alternate_recompute_params(m) == pytest.approx(at_ep1)
    assert flops.alternate_recompute_params(m, ep=2) == pytest.approx(at_ep2)


def test_checkpointed_blocks_of_a_stage_starting_at_an_odd_block(tmp_path) -> None:
    """Stages of 1 and 3 blocks, every 2nd block wrapped: the second stage runs blocks 1-3 and wraps
    block 2 alone (global indices), though a count of its own blocks would say ceil(3 / 2) = 2. The
    trainer's wrapping, the layout's per-rank shapes and the time model's collectives agree."""
    from trainfit.parallel.pipeline import split_stages
    from trainfit.recompute import apply_activation_checkpointing

    cfg = run_config(tmp_path, "--model.num_layers=4", "--hardware.num_gpus=2", "--parallel.pp=2",
                     "--parallel.pp_layers_per_stage=1,3", "--parallel.pp_schedule=1f1b",
                     "--memory.activation_checkpointing=full", "--memory.ac_every_n_layers=2",
                     "--parallel.cp=1", "--training.global_batch_size=8")
    layout = build_layout(cfg, 2)
    (stage,) = split_stages(build_model(cfg.model), layout, pp_rank=1)
    assert apply_activation_checkpointing(stage, "full", 2) == 1
    assert max(layout.rank_shapes())[:2] == (3, 1)
    cp = run_config(tmp_path, "--model.num_layers=8", "--hardware.num_gpus=4", "--parallel.pp=2",
                    "--parallel.cp=2", "--parallel.pp_layers_per_stage=1,7", "--parallel.pp_schedule=1f1b",
                    "--memory.activation_checkpointing=full", "--memory.ac_every_n_layers=2",
                    "--training.global_batch_size=8")
    layout = build_layout(cp, 4)
    recomputed_kv = [c for c in comms.step_collectives(cp.model, layout, cp.training)
                     if c.purpose == "cp" and c.phase == "backward" and c.kind == "all_gather"]
    # blocks 1-7 wrap 2, 4 and 6: each recomputation all-gathers keys and values again (2 per block)
    assert sum(c.count for c in recomputed_kv) == 2 * 3 * layout.num_microbatches
