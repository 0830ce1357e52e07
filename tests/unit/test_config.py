"""The config contract: defaults, TOML, overrides, and errors that name field, value and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfit.cli import main
from trainfit.config import SECTIONS, ConfigError, field_docs, iter_fields, split_overrides
from trainfit.configure import config_from_dict, load_config

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_defaults_resolve_the_tiny_preset() -> None:
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert cfg.model.dim == 256 and cfg.model.num_kv_heads == 4 and cfg.model.expert_ffn_dim == 768


def test_tiny_example_is_the_default() -> None:
    assert load_config(EXAMPLES / "tiny.toml") == load_config()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_validates(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.model.dim and cfg.model.num_layers


def test_overrides_take_types_from_the_schema() -> None:
    cfg = load_config(None, ["--training.steps=30", "--precision.mode=bf16-mixed", "--optimizer.betas=0.8,0.9",
                             "--logging.tensorboard=true", "--training.lr=1e-3", "--parallel.zero_stage=2"])
    assert cfg.training.steps == 30
    assert cfg.precision.mode == "bf16-mixed"
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.logging.tensorboard is True
    assert cfg.training.lr == 1e-3
    assert cfg.parallel.zero_stage == 2


def test_overrides_with_a_space_equal_those_with_equals() -> None:
    spaced = load_config(None, ["--training.steps", "5", "--parallel.dp_shard", "-1", "--optimizer.betas", "0.9,0.95",
                                "--training.lr", "1e-3", "--hardware.gpu", "H100-SXM-80GB"])
    equals = load_config(None, ["--training.steps=5", "--parallel.dp_shard=-1", "--optimizer.betas=0.9,0.95",
                                "--training.lr=1e-3", "--hardware.gpu=H100-SXM-80GB"])
    assert spaced == equals
    assert (spaced.training.steps, spaced.parallel.dp_shard, spaced.optimizer.betas) == (5, -1, (0.9, 0.95))


def test_split_overrides_leaves_the_other_arguments() -> None:
    argv = ["estimate", "cfg.toml", "--json", "--training.steps", "5", "--parallel.dp_shard", "-1",
            "--plot=a.png", "--optimizer.betas=0.9,0.95", "--data.path=--odd"]
    assert split_overrides(argv) == (
        ["estimate", "cfg.toml", "--json", "--plot=a.png"],
        ["--training.steps=5", "--parallel.dp_shard=-1", "--optimizer.betas=0.9,0.95", "--data.path=--odd"],
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--data.path", "--json"], "override '--data.path' has no value: the next argument, '--json', starts "
                                    "with '--' and is read as an option; write --data.path=VALUE"),
        (["--training.steps"], "override '--training.steps' has no value: write --training.steps=VALUE or "
                               "--training.steps VALUE"),
    ],
)
def test_an_override_without_a_value_is_rejected(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        split_overrides(argv)
    assert str(err.value).startswith(expected)


def test_the_cli_takes_both_override_forms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--json", "--model.num_layers", "3", "--parallel.dp_shard", "-1",
                 "--optimizer.betas", "0.9,0.95", "--hardware.num_gpus=2", "--training.micro_batch_size", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_layers"] == 3 and out["per_rank"]["layout"]["dp_shard"] == 2
    assert main(["estimate", "--training.steps", "--json"]) == 2
    assert "override '--training.steps' has no value" in capsys.readouterr().err


def test_explicit_dims_override_the_preset() -> None:
    cfg = load_config(None, ["--model.num_layers=2", "--model.dim=128", "--model.ffn_dim=256"])
    assert (cfg.model.num_layers, cfg.model.dim, cfg.model.num_heads) == (2, 128, 8)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--training.stepz=3"], "training.stepz='3': unknown field; did you mean 'steps'?"),
        (["--trainin.steps=3"], "did you mean 'training'?"),
        (["--precision.mode=fp64"], "precision.mode='fp64': choose one of fp32 | bf16-mixed"),
        (["--training.steps=abc"], "training.steps='abc': must be an integer"),
        (["--training.steps=0"], "training.steps=0: must be >= 1"),
        (["--model.num_heads=7"], "model.num_heads=7: must divide model.dim=256"),
        (["--model.num_kv_heads=3"], "model.num_kv_heads=3: must divide model.num_heads=8"),
        (["--training.seq_len=4096"], "training.seq_len=4096: must be <= model.max_seq_len=512"),
        (["--training.min_lr=1"], "training.min_lr=1.0: must be between 0 and training.lr"),
        (["--model.preset=debug-moe", "--model.capacity_factor=-1"], "model.capacity_factor=-1.0: must be >= 0"),
        (["--memory.moe_imbalance=0.5"], "memory.moe_imbalance=0.5: must be >= 1"),
        (["--memory.moe_imbalance=nan"], "memory.moe_imbalance=nan: must be a number, not NaN"),
        (["--model.preset=llama9"], "model.preset='llama9': unknown preset"),
        (["--optimizer.betas=0.9,1.5"], "optimizer.betas=(0.9, 1.5): each beta must be in [0, 1)"),
        (["steps=3"], "write it as --section.field=value"),
    ],
)
def test_bad_values_fail_with_field_value_and_fix(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value)


def test_toml_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    bad.write_text("[training]\nsteps = '3'\n")
    with pytest.raises(ConfigError, match="training.steps='3': must be an integer"):
        load_config(bad)
    bad.write_text("[training]\nsteps = 3\n[logging]\nfoo = 1\n")
    with pytest.raises(ConfigError, match="logging.foo=1: unknown field"):
        load_config(bad)


def test_toml_accepts_int_for_float_and_list_for_tuple() -> None:
    cfg = config_from_dict({"training": {"lr": 1}, "optimizer": {"betas": [0.9, 0.99]}})
    assert cfg.training.lr == 1.0 and isinstance(cfg.training.lr, float)
    assert cfg.optimizer.betas == (0.9, 0.99)


def test_every_field_has_a_docstring() -> None:
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"[{section}] fields without a docstring: {missing}"
    assert sum(1 for _ in iter_fields()) > 60
