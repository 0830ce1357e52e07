"""Chat templates (train/chat_template.py) and fine-tuning samples (train/samples.py) against transformers'
apply_chat_template: the same text, the same token ids, the same assistant mask, on a tokenizer trained
here and saved as a model folder is (tokenizer.json + tokenizer_config.json), and on the real templates
copied into tests/data/chat_templates/ (SOURCES.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainfit.config import ConfigError
from trainfit.train.chat_template import BUILT_IN, ChatTemplate, find_chat_template, template_kwargs
from trainfit.train.records import Record
from trainfit.train.samples import encode_record
from trainfit.train.tokenizer import HFTokenizer

TEMPLATES = Path(__file__).parents[2] / "data" / "chat_templates"
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Which colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass, café?"},
    {"role": "assistant", "content": "Green."},
]


def _model_folder(root: Path, template: str, specials: list[str], **tokens: str) -> Path:
    """A tokenizer trained here, saved as a Hugging Face model folder saves one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([json.dumps(CONVERSATION)] * 20 + ["system user assistant"] * 5, trainer=trainer)
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **tokens}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def _transformers(folder: Path, messages: list[dict], **kwargs: object) -> dict:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)


def _ids(value: object) -> list[int]:
    return list(value.ids if hasattr(value, "ids") else value)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_a_built_in_template_gives_transformers_ids_and_assistant_mask(name: str, tmp_path: Path) -> None:
    source, tokens = BUILT_IN[name]
    specials = CHATML_SPECIALS if name == "chatml" else LLAMA3_SPECIALS
    folder = _model_folder(tmp_path / name, source, specials, **tokens)
    expected = _transformers(folder, CONVERSATION, return_assistant_tokens_mask=True)
    template = find_chat_template("", [str(folder)])
    tok = HFTokenizer.from_file(folder / "tokenizer.json")
    sample = encode_record(Record("test", messages=tuple(CONVERSATION)), tok, template, "completion")
    assert sample.ids.tolist() == _ids(expected["input_ids"])
    assert sample.trained.astype(int).tolist() == list(expected["assistant_masks"])
    assert sample.trained.sum() > 4  # both answers and their end-of-turn tokens


def test_masks_from_prefixes_equal_the_generation_blocks(tmp_path: Path) -> None:
    """A template without {% generation %} (ChatML as most models ship it) is masked by rendering each prefix:
    the assistant's text and end-of-turn, as the built-in's generation blocks mark them, plus the newline
    the template writes after <|im_end|> (which the model is also asked to write)."""
    plain = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
             "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
             "{% endif %}")
    marked = ChatTemplate(BUILT_IN["chatml"][0], "chatml").render_trained(CONVERSATION)
    prefixed = ChatTemplate(plain, "plain").render_trained(CONVERSATION)
    assert prefixed.text == marked.text
    assert [(s, e - 1) for s, e in prefixed.trained] == list(marked.trained)
    assert [prefixed.text[s:e] for s, e in prefixed.trained] == ["Blue.<|im_end|>\n", "Green.<|im_end|>\n"]


def test_a_template_that_rewrites_earlier_turns_is_masked_where_it_writes_them() -> None:
    """A template that writes a turn otherwise once others follow it (so a prefix's text is not where the
    whole one starts: Qwen3 drops earlier answers' reasoning) is masked by finding each answer in the whole
    text, with the end-of-turn token after it; one that does not write the answer as the record has it is
    refused."""
    moving = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<eot>{% endif %}"
              "{% if loop.last %}!{% else %};{% endif %}{% endfor %}")
    found = ChatTemplate(moving, "moving", {"eos_token": "<eot>"}).render_trained(CONVERSATION)
    assert [found.text[s:e] for s, e in found.trained] == ["Blue.<eot>", "Green.<eot>"]
    shouting = "{% for m in messages %}{{ m['content'] | upper }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(ConfigError, match="turn 3's content"):
        ChatTemplate(shouting, "shouting").render_trained(CONVERSATION)


@pytest.mark.parametrize("path", sorted(TEMPLATES.glob("*.jinja")), ids=lambda p: p.stem)
def test_real_templates_render_as_transformers_renders_them(path: Path, tmp_path: Path) -> None:
    facts = json.loads(path.with_suffix(".json").read_text())
    messages = CONVERSATION if facts.get("system_allowed", True) else CONVERSATION[1:]
    tokens = {k: facts[k] for k in ("bos_token", "eos_token") if facts.get(k)}
    specials = sorted({*facts.get("special_tokens", []), *tokens.values()})
    folder = _model_folder(tmp_path / path.stem, path.read_text(), specials, **tokens)
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    template = find_chat_template("", [str(folder)])
    for generation_prompt in (False, True):
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert template.render(messages, add_generation_prompt=generation_prompt) == expected
    ours = HFTokenizer.from_file(folder / "tokenizer.json")
    sample = encode_record(Record(path.stem, messages=tuple(messages)), ours, template, "completion")
    assert sample.ids.tolist() == _ids(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    text = tok.decode(sample.ids[sample.trained].tolist())
    assert "Blue." in text and "Green." in text and "colour" not in text


def test_the_template_comes_from_chat_template_jinja_first(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m", "{{ 'from config' }}", CHATML_SPECIALS, eos_token="<|im_end|>")
    (folder / "chat_template.jinja").write_text("{{ 'from file ' + eos_token }}")
    template = find_chat_template("", [str(folder)])
    assert template.render(CONVERSATION) == "from file <|im_end|>"
    with pytest.raises(ConfigError, match="found no chat template"):
        find_chat_template("", [str(tmp_path / "empty")])
    with pytest.raises(ConfigError, match="no such file"):
        find_chat_template(str(tmp_path / "absent.jinja"), [])


def test_template_errors_name_the_template_and_the_record() -> None:
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}", "broken")
    refusing = ChatTemplate("{{ raise_exception('System role not supported') }}", "gemma-like")
    with pytest.raises(ConfigError, match="gemma-like failed on data.jsonl:3.*System role not supported"):
        refusing.render(CONVERSATION, where="data.jsonl:3")


def test_a_prompt_completion_trains_on_the_completion_only() -> None:
    from trainfit.train.tokenizer import ByteTokenizer

    sample = encode_record(Record("r", text="2 + 2 = 4", text_trained_from=8), ByteTokenizer(), None, "completion")
    assert bytes(sample.ids[sample.trained].astype(np.uint8)).decode() == "4"
    everything = encode_record(Record("r", text="2 + 2 = 4", text_trained_from=8), ByteTokenizer(), None, "all")
    assert everything.trained.all()


def test_template_options_reach_the_template_as_transformers_passes_them(tmp_path: Path) -> None:
    """data.chat_template_kwargs (Qwen3's enable_thinking): the same text as apply_chat_template's keyword."""
    path = TEMPLATES / "qwen3.jinja"
    facts = json.loads(path.with_suffix(".json").read_text())
    folder = _model_folder(tmp_path / "qwen3", path.read_text(), facts["special_tokens"], eos_token=facts["eos_token"])
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    kwargs = template_kwargs('{"enable_thinking": false}')
    template = find_chat_template("", [str(folder)], kwargs)
    asked = CONVERSATION[:2]
    expected = tok.apply_chat_template(asked, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert template.render(asked, add_generation_prompt=True) == expected
    assert expected != tok.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
    for bad, message in (("{enable", "not JSON"), ("[1]", "a JSON list, not an object")):
        with pytest.raises(ConfigError, match=message):
            template_kwargs(bad)
