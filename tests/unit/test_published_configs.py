"""The published config.json files of models trainfit is to support next (tests/data/hf_configs, each
with its source in SOURCES.md): they are what their model cards say (transformers' own classes, on the
meta device, count the card's parameters from them), and until trainfit reads their model_type each
is refused with the named error that lists what it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfit.config import ConfigError
from trainfit.models.hf import SUPPORTED_TYPES, model_fields_from_hf_config

DATA = Path(__file__).parents[1] / "data" / "hf_configs"
CARD_BILLIONS = {  # the model card's "Number of Parameters" (SOURCES.md names each copy of the card)
    "Qwen--Qwen3-0.6B.json": 0.6, "Qwen--Qwen3-1.7B.json": 1.7, "Qwen--Qwen3-4B.json": 4.0,
    "Qwen--Qwen3-8B.json": 8.2, "Qwen--Qwen3-14B.json": 14.8, "Qwen--Qwen3-32B.json": 32.8,
    "Qwen--Qwen3-30B-A3B.json": 30.5, "microsoft--phi-4.json": 14.7,
    "microsoft--Phi-3-mini-4k-instruct.json": 3.8,
}
FILES = sorted(p.name for p in DATA.glob("*.json"))


def test_every_file_has_its_source_and_card_figure() -> None:
    sources = (DATA / "SOURCES.md").read_text(encoding="utf-8")
    assert sorted(CARD_BILLIONS) == FILES and all(f"`{name}`" in sources for name in FILES)


def test_transformers_counts_each_cards_parameters_from_its_file() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for name in FILES:
        hf = json.loads((DATA / name).read_text(encoding="utf-8"))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
        billions = sum(p.numel() for p in model.parameters()) / 1e9
        assert round(billions, 1) == CARD_BILLIONS[name], (name, billions)


@pytest.mark.parametrize("name", FILES)
def test_a_type_not_read_yet_is_refused_naming_what_is(name: str) -> None:
    model_type = json.loads((DATA / name).read_text(encoding="utf-8"))["model_type"]
    assert model_type not in SUPPORTED_TYPES
    with pytest.raises(ConfigError) as err:
        model_fields_from_hf_config(DATA / name)
    assert f"model_type={model_type!r}: not supported" in str(err.value)
    assert all(t in str(err.value) for t in SUPPORTED_TYPES)
