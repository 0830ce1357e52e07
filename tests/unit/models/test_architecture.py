"""The architecture description's layer kinds (models/architecture.py): Gemma's windowed and global layers,
each with its RoPE, are one block of tensors whose span is read layer by layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainfit.config import ModelConfig
from trainfit.models import build_model, materialize
from trainfit.models.architecture import describe
from trainfit.models.presets import resolve_model_config
from trainfit.train.trainer import attention_layers_note


def _gemma3(**changes: object) -> ModelConfig:
    return resolve_model_config(ModelConfig(preset="gemma-3-1b", num_layers=7, **changes))


def test_gemma3s_pattern_is_five_windowed_layers_to_one_global_each_with_its_rope() -> None:
    arch = describe(_gemma3())
    assert [la.attention.window for la in arch.layers] == [512] * 5 + [0] + [512]
    assert [la.attention.rope_theta for la in arch.layers] == [1e4] * 5 + [1e6] + [1e4]
    assert arch.rope_keys == ((1e4, False), (1e6, False)) and arch.masked_windows(4096) == (512,)
    assert arch.masked_windows(512) == ()  # a sequence within the window: plain causal attention
    block = arch.block  # the tensors every layer has, its span unset: whatever reads one must ask per layer
    assert block.attention.window is None and block.attention.head_dim == 256
    with pytest.raises(ValueError, match="read Architecture.layers"):
        block.attention.masked(4096)


def test_layers_that_differ_in_their_tensors_have_no_common_block() -> None:
    arch = describe(_gemma3())
    first = arch.layers[0]
    changed = dataclasses.replace(arch, layers=(first, dataclasses.replace(first, ffn=dataclasses.replace(
        first.ffn, hidden=8))))
    with pytest.raises(ValueError, match="differ in their tensors"):
        _ = changed.block


def test_the_model_builds_one_pair_of_rope_tables_per_setting_and_scales_the_global_ones() -> None:
    cfg = _gemma3(dim=64, num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=32, vocab_size=64, max_seq_len=32,
                  rope_scaling_type="linear", rope_scaling_factor=8.0)
    model = materialize(build_model(cfg), "cpu")
    local, scaled = model.rope_cos, model.rope_cos_1
    assert local.shape == scaled.shape == (32, 16)
    position = 8  # the global layers' frequencies are the plain ones divided by 8: position p as p / 8
    base = 1e6 ** -(torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    torch.testing.assert_close(scaled[position, :8], torch.cos(position * base / 8))
    torch.testing.assert_close(local[position, :8], torch.cos(position * 1e4 ** -(torch.arange(0, 16, 2) / 16)))


def test_the_run_log_names_what_each_kind_of_layer_runs() -> None:
    assert attention_layers_note(describe(_gemma3()), 4096) == (
        "attention: 6 of 7 layers attend a window of 512 positions (SDPA with an explicit mask, the kernel "
        "above), the other 1 the whole causal sequence")
    assert attention_layers_note(describe(_gemma3()), 256) is None
    gemma2 = resolve_model_config(ModelConfig(preset="gemma-2-2b"))
    assert "eager attention" in attention_layers_note(describe(gemma2), 4096)


def test_dense_and_moe_layers_are_kinds_each_priced_as_its_own_block() -> None:
    """The first layer dense, then every second MoE: each kind a model of its own; the count, the FLOPs and the
    compute time add the layers up kind by kind."""
    from trainfit.configure import load_config
    from trainfit.models.architecture import kind_of_layers, layer_kinds
    from trainfit.models.params import param_counts
    from trainfit.parallel.resolve import build_layout
    from trainfit.perf import flops
    from trainfit.perf.timing import compute_time_s

    cfg = load_config(None, ["--model.preset=debug-moe", "--model.num_layers=5", "--model.moe_dense_layers=1",
                             "--model.moe_layer_step=2"])
    m = cfg.model
    assert [bool(la.moe) for la in describe(m).layers] == [False, True, False, True, False]
    dense, moe = layer_kinds(m)
    assert (dense.num_experts, moe.num_experts) == (0, 4) and kind_of_layers(m) == (0, 1, 0, 1, 0)
    with pytest.raises(ValueError, match="differ in their tensors"):
        _ = describe(m).block
    whole, d, e = param_counts(m), param_counts(dense), param_counts(moe)
    assert whole.total == d.embedding + 3 * d.per_layer + 2 * e.per_layer + d.final_norm + d.output
    assert whole.active == whole.total - 2 * (e.mlp - e.mlp_active)
    head = flops.head_matmul_params(m)
    assert flops.matmul_params_per_token(m) - head == (3 * (flops.matmul_params_per_token(dense) - head)
                                                       + 2 * (flops.matmul_params_per_token(moe) - head)) // 5
    layout = build_layout(cfg)
    assert compute_time_s(m, layout, cfg.training, cfg.hardware) == pytest.approx(
        0.6 * compute_time_s(dense, layout, cfg.training, cfg.hardware)
        + 0.4 * compute_time_s(moe, layout, cfg.training, cfg.hardware))
