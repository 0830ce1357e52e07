"""The published config.json files of the models trainfit reads (tests/data/hf_configs, each with its
source in SOURCES.md): they are what their model cards say (transformers' own classes, on the meta
device, count the card's parameters from them), each loads as trainfit's model with exactly the
parameters transformers builds from it and estimates, and its preset is that file's model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from trainfit.config import ConfigError, ModelConfig
from trainfit.configure import load_config
from trainfit.estimate import as_json, estimate
from trainfit.models import build_model, count_params
from trainfit.models.hf import SUPPORTED_TYPES, model_fields_from_hf_config, model_fields_of_hf
from trainfit.models.params import param_counts
from trainfit.models.presets import PRESETS, PUBLISHED_NUM_PARAMS, resolve_model_config

DATA = Path(__file__).parents[1] / "data" / "hf_configs"
CARD_BILLIONS = {  # the model card's "Number of Parameters" (SOURCES.md names each copy of the card)
    "Qwen--Qwen3-0.6B.json": 0.6, "Qwen--Qwen3-1.7B.json": 1.7, "Qwen--Qwen3-4B.json": 4.0,
    "Qwen--Qwen3-8B.json": 8.2, "Qwen--Qwen3-14B.json": 14.8, "Qwen--Qwen3-32B.json": 32.8,
    "Qwen--Qwen3-30B-A3B.json": 30.5, "microsoft--phi-4.json": 14.7,
    "microsoft--Phi-3-mini-4k-instruct.json": 3.8, "mistralai--Mistral-Small-24B-Instruct-2501.json": 24.0,
    "google--gemma-3-1b-it.json": 1.0, "google--gemma-3-4b-it.json": 4.0, "google--gemma-3-27b-it.json": 27.0,
    "google--gemma-3-12b-it.json": 12.0, "allenai--OLMo-2-1124-7B.json": 7.0, "allenai--OLMo-2-1124-13B.json": 13.0,
    "openai--gpt-oss-20b.json": 20.9, "openai--gpt-oss-120b.json": 116.8,
}
CARD_ACTIVE_BILLIONS = {"openai--gpt-oss-20b.json": 3.61, "openai--gpt-oss-120b.json": 5.13}
"""The gpt-oss model card's (arXiv 2508.10925, Table 1) active parameters per token: all but the input embedding
of the routed experts a token passes through (top-4)."""
SIZE_CLASS = {"allenai--OLMo-2-1124-7B.json", "allenai--OLMo-2-1124-13B.json"}
"""Files whose card names a size class only ("7B and 13B models"): the count lies between it and the next."""
NON_EMBEDDING = {  # the Gemma 2 report's (arXiv 2408.00118) non-embedding parameters (SOURCES.md)
    "google--gemma-2-2b-it.json": 2_024_517_888, "google--gemma-2-9b-it.json": 8_324_201_984,
    "google--gemma-2-27b-it.json": 26_047_480_320,
}
MULTIMODAL = {"google--gemma-3-4b-it.json", "google--gemma-3-12b-it.json", "google--gemma-3-27b-it.json"}
"""Files of a multimodal model whose text model alone trainfit builds: the card's figure counts the vision
tower too (Gemma 3 27B's report figure, 25.6B + 1.4B of embeddings, is the text model's)."""
PRESET_OF = {
    "Qwen--Qwen3-0.6B.json": "qwen3-0.6b", "Qwen--Qwen3-1.7B.json": "qwen3-1.7b", "Qwen--Qwen3-4B.json": "qwen3-4b",
    "Qwen--Qwen3-8B.json": "qwen3-8b", "Qwen--Qwen3-14B.json": "qwen3-14b", "Qwen--Qwen3-32B.json": "qwen3-32b",
    "Qwen--Qwen3-30B-A3B.json": "qwen3-30b-a3b", "microsoft--phi-4.json": "phi-4",
    "microsoft--Phi-3-mini-4k-instruct.json": "phi-3-mini",
    "mistralai--Mistral-Small-24B-Instruct-2501.json": "mistral-small-24b", "google--gemma-3-1b-it.json": "gemma-3-1b",
    "google--gemma-3-4b-it.json": "gemma-3-4b", "google--gemma-3-27b-it.json": "gemma-3-27b",
    "google--gemma-2-2b-it.json": "gemma-2-2b", "google--gemma-2-9b-it.json": "gemma-2-9b",
    "google--gemma-2-27b-it.json": "gemma-2-27b", "google--gemma-3-12b-it.json": "gemma-3-12b",
    "allenai--OLMo-2-1124-7B.json": "olmo-2-7b", "allenai--OLMo-2-1124-13B.json": "olmo-2-13b",
    "openai--gpt-oss-20b.json": "gpt-oss-20b", "openai--gpt-oss-120b.json": "gpt-oss-120b",
}
FILES = sorted(p.name for p in DATA.glob("*.json"))


def _transformers_count(name: str) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = json.loads((DATA / name).read_text(encoding="utf-8"))
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):  # a multimodal model's text model (the causal LM of its text_config)
        model = transformers.AutoModelForCausalLM.from_config(getattr(config, "text_config", config))
    return sum(p.numel() for p in model.parameters())


def _ours(preset: str) -> ModelConfig:
    return resolve_model_config(ModelConfig(preset=preset))


def test_every_file_has_its_source_card_figure_and_preset() -> None:
    sources = (DATA / "SOURCES.md").read_text(encoding="utf-8")
    assert sorted({**CARD_BILLIONS, **NON_EMBEDDING}) == sorted(PRESET_OF) == FILES
    assert all(f"`{name}`" in sources for name in FILES)
    assert set(PRESETS) >= set(PRESET_OF.values())


@pytest.mark.filterwarnings("ignore:.*vision tower")
@pytest.mark.parametrize("name", FILES)
def test_each_file_is_its_cards_model_and_loads_with_transformers_count(name: str) -> None:
    theirs = _transformers_count(name)
    if name in NON_EMBEDDING:  # the report's figure exactly, beside the embedding
        hf = json.loads((DATA / name).read_text(encoding="utf-8"))
        assert theirs == NON_EMBEDDING[name] + hf["vocab_size"] * hf["hidden_size"]
    elif name in SIZE_CLASS:
        assert CARD_BILLIONS[name] <= theirs / 1e9 < CARD_BILLIONS[name] + 1
    elif name in MULTIMODAL:
        card = CARD_BILLIONS[name] * 1e9
        assert 0.9 * card < theirs < card if name != "google--gemma-3-27b-it.json" else round(theirs / 1e9, 1) == 27.0
    else:  # the cards round (Mistral Small's 23.6B to 24B)
        assert theirs == pytest.approx(CARD_BILLIONS[name] * 1e9, rel=0.02)
    with pytest.warns(UserWarning, match="vision tower") if name in MULTIMODAL else contextlib.nullcontext():
        cfg = _ours(str(DATA / name))
    assert count_params(build_model(cfg)) == theirs == param_counts(cfg).total  # the trainer's and the estimators'
    preset = PRESET_OF[name]
    assert PUBLISHED_NUM_PARAMS[preset] == theirs
    assert {k: v for k, v in vars(_ours(preset)).items() if k != "preset"} == \
        {k: v for k, v in vars(cfg).items() if k != "preset"}


@pytest.mark.filterwarnings("ignore:.*vision tower")
@pytest.mark.parametrize("name", ["Qwen--Qwen3-8B.json", "Qwen--Qwen3-30B-A3B.json", "microsoft--phi-4.json",
                                  "google--gemma-3-27b-it.json", "mistralai--Mistral-Small-24B-Instruct-2501.json",
                                  "google--gemma-2-9b-it.json", "openai--gpt-oss-20b.json"])
def test_a_flagship_estimates_from_its_file(name: str) -> None:
    cfg = load_config(None, [f"--model.preset={DATA / name}", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                             "--parallel.zero_stage=3", "--precision.mode=bf16-mixed",
                             "--training.seq_len=4096", "--training.micro_batch_size=1"])
    result, count = estimate(cfg), _transformers_count(name)
    assert as_json(result)["model"]["num_params"] == count
    # ZeRO-3 over 8 ranks: each holds an eighth of the fp32 master weights (and of the rest)
    assert result.worst.master_params == pytest.approx(4 * count / 8, rel=0.01)
    assert result.worst.peak > result.worst.master_params and 0 < result.perf.time["mfu"] < 1


@pytest.mark.parametrize("name", sorted(CARD_ACTIVE_BILLIONS))
def test_an_moe_files_active_parameters_are_its_cards(name: str) -> None:
    cfg = _ours(str(DATA / name))
    without_input_embedding = param_counts(cfg).active - cfg.vocab_size * cfg.dim
    assert round(without_input_embedding / 1e9, 2) == CARD_ACTIVE_BILLIONS[name]


def test_the_sliding_windows_are_read_where_they_are_shorter_than_the_context() -> None:
    assert model_fields_from_hf_config(DATA / "microsoft--Phi-3-mini-4k-instruct.json")["sliding_window"] == 2047
    assert model_fields_from_hf_config(DATA / "microsoft--phi-4.json")["sliding_window"] == 0  # its context
    gemma = model_fields_from_hf_config(DATA / "google--gemma-3-1b-it.json")  # five windowed layers to one global
    assert (gemma["sliding_window"], gemma["sliding_window_pattern"], gemma["rope_local_theta"]) == (512, 6, 1e4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama4"])
def test_a_type_not_read_yet_is_refused_naming_what_is(model_type: str) -> None:
    assert model_type not in SUPPORTED_TYPES
    with pytest.raises(ConfigError) as err:
        model_fields_of_hf({"model_type": model_type, "hidden_size": 64})
    assert f"model_type={model_type!r}: not supported" in str(err.value)
    assert all(t in str(err.value) for t in SUPPORTED_TYPES)
