"""Presets: official sizes match the published parameter counts; the config path stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainfit.config import ModelConfig
from trainfit.configure import load_config
from trainfit.models import build_model, count_params
from trainfit.models.params import param_counts
from trainfit.models.presets import PRESETS, PUBLISHED_NUM_PARAMS


@pytest.mark.parametrize("name", sorted(PUBLISHED_NUM_PARAMS))
def test_preset_matches_published_param_count(name: str) -> None:
    model = build_model(ModelConfig(preset=name))
    assert next(model.parameters()).is_meta
    n = count_params(model)
    assert abs(n - PUBLISHED_NUM_PARAMS[name]) <= 0.005 * PUBLISHED_NUM_PARAMS[name], (name, n)


def test_every_official_preset_has_a_published_count() -> None:
    official = {name for name in PRESETS if not name.startswith(("tiny", "debug"))}
    assert official == set(PUBLISHED_NUM_PARAMS)
    assert {"tiny", "debug", "debug-moe", "debug-gpt2"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name: str) -> None:
    cfg = load_config(overrides=[f"--model.preset={name}", "--training.seq_len=64"])
    assert cfg.model.dim == PRESETS[name]["dim"]


def test_count_params_counts_tied_weights_once() -> None:
    tied = build_model(ModelConfig(preset="debug", tie_embeddings=True))
    untied = build_model(ModelConfig(preset="debug", tie_embeddings=False))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert count_params(untied) - count_params(tied) == 256 * 64


def test_config_and_hf_config_path_do_not_import_torch(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 128}'
    )
    code = (
        "import sys, trainfit, trainfit.models, trainfit.models.presets, trainfit.models.hf\n"
        f"cfg = trainfit.load_config(overrides=['--model.preset={tmp_path}', '--training.seq_len=64'])\n"
        "assert cfg.model.vocab_size == 300, cfg.model\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_closed_form_counts_equal_the_built_model(name: str) -> None:
    """The torch-free counts the estimator uses equal the real module tree, per component."""
    cfg = load_config(None, [f"--model.preset={name}"]).model
    model = build_model(cfg)
    counts = param_counts(cfg)
    assert counts.total == count_params(model)
    block = model.layers[0]
    assert counts.per_layer == sum(p.numel() for p in block.parameters())
    norms = {n: p.numel() for n, p in block.named_parameters() if n.rsplit(".", 2)[-2].endswith("norm")}
    assert counts.norms == sum(norms.values())  # the pre-norms' and QK-norm's
    assert counts.attention == sum(p.numel() for n, p in block.attention.named_parameters()
                                   if f"attention.{n}" not in norms)
    assert counts.mlp == sum(p.numel() for p in block.feed_forward.parameters())
    if cfg.num_experts:
        assert counts.routed_experts == sum(p.numel() for p in block.feed_forward.experts.parameters())
        expert = counts.routed_experts // cfg.num_experts
        assert counts.active == counts.total - cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * expert
    else:
        assert counts.active == counts.total


def test_olmoe_matches_the_papers_total_and_active_counts() -> None:
    """OLMoE-1B-7B: 6.9B parameters, 1.3B active per token (Muennighoff et al. 2024, arXiv 2409.02060,
    Table 1), figures rounded to 0.1B: ours within half of that (6.919B and 1.282B)."""
    counts = param_counts(load_config(None, ["--model.preset=olmoe-1b-7b"]).model)
    assert abs(counts.total - 6.9e9) <= 0.05e9, counts.total
    assert abs(counts.active - 1.3e9) <= 0.05e9, counts.active
    assert counts.routed_experts == 64 * 3 * 2048 * 1024  # one layer's 64 experts: 403M of its 420M
