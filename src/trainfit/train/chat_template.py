"""A model's chat template: the Jinja program that turns a conversation into the text the model was
tuned on, and which characters of it are the assistant's (what the loss trains on).

Rendered as transformers renders it (`apply_chat_template`: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` filter that
keeps non-ASCII text, the tokenizer's special tokens as variables), so the same conversation gives the
same string and, tokenized with special tokens recognised, the same ids. The assistant's characters come
from the template's own `{% generation %}` blocks where it has them, else from rendering each prefix of
the conversation: the text an assistant turn adds after the prompt that asks for it; for a template that
writes earlier turns otherwise than a prefix ends (Qwen3's, Mistral's), each assistant content as the
whole text writes it, with the end-of-turn token after it. A turn found neither way is refused.

Where the template comes from (`find_chat_template`): `data.chat_template` naming a built-in (chatml,
llama3) or a file; else the tokenizer's or the model's folder (chat_template.jinja, which transformers 5
writes, else tokenizer_config.json's `chat_template`). Torch-free.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
_OPEN, _CLOSE = "\ue000", "\ue001"
"""Private-use characters that bracket a `{% generation %}` block's output while rendering."""

BUILT_IN: dict[str, tuple[str, dict[str, str]]] = {
    # ChatML (OpenAI's format, which Qwen and SmolLM use): <|im_start|>role\ncontent<|im_end|>\n; the
    # assistant's content and its end-of-turn token are what it generates.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{{ '\\n' }}"
        "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        {"eos_token": "<|im_end|>"}),
    # Llama 3's header format (Meta's model card): the begin-of-text token, each turn's role between
    # header tokens, its content, <|eot_id|>.
    "llama3": (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}
"""Templates for models without one of their own, with the special tokens they name."""

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class Rendered:
    """A conversation as its template writes it, and the spans of it the loss trains on."""

    text: str
    trained: tuple[tuple[int, int], ...]
    """[start, end) character spans of `text`: the assistant turns (content and end-of-turn)."""


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens it is rendered with."""

    source: str
    """The Jinja text."""
    origin: str
    """Where it came from (a file, a built-in's name), for messages."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token, eos_token, ...: the tokenizer's, as transformers passes them."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """data.chat_template_kwargs: the template's own options (enable_thinking, ...)."""

    def __post_init__(self) -> None:
        self._template = _compile(self.source, self.origin)
        self.has_generation = bool(re.search(r"{%-?\s*generation\s*-?%}", self.source))

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               where: str = "") -> str:
        """The template's text of `messages` (generation blocks unmarked)."""
        return _strip_marks(self._render(messages, add_generation_prompt, where))

    def render_trained(self, messages: Sequence[dict[str, Any]], where: str = "") -> Rendered:
        """The conversation's text and its assistant spans (module docstring)."""
        if self.has_generation:
            return _marked_spans(self._render(messages, False, where))
        full = self.render(messages, where=where)
        spans, end = [], 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            asked = self.render(messages[:i], add_generation_prompt=True, where=where)
            answered = self.render(messages[:i + 1], where=where)
            if not (answered.startswith(asked) and full.startswith(answered) and len(asked) >= end):
                return Rendered(full, self._found_spans(full, messages, where))
            spans.append((len(asked), len(answered)))
            end = len(answered)
        return Rendered(full, tuple(spans))

    def _found_spans(self, full: str, messages: Sequence[dict[str, Any]], where: str) -> tuple[tuple[int, int], ...]:
        """The assistant spans of a template that writes earlier turns otherwise than a prefix ends (Qwen3's
        drops their reasoning; Mistral's moves the system prompt to the last user turn): each message's
        content found in the whole text after the previous one's (a message the template leaves out moves
        nothing), an assistant's with the end-of-turn token that follows it."""
        spans, cursor = [], 0
        eos = self.special_tokens.get("eos_token", "")
        for i, message in enumerate(messages):
            content = str(message.get("content") or "").strip()
            at = full.find(content, cursor) if content else -1
            if at < 0:
                if message.get("role") == "assistant":
                    raise ConfigError(f"data.chat_template: {where or 'a conversation'}: {self.origin} does not "
                                      f"write turn {i + 1}'s content as the record has it, so which tokens are the "
                                      "assistant's cannot be told; use a template with {% generation %} blocks "
                                      "(data.chat_template=FILE) or data.loss_on=all")
                continue
            end = at + len(content)
            if message.get("role") == "assistant":
                after = len(full[end:]) - len(full[end:].lstrip())
                if eos and full.startswith(eos, end + after):
                    end += after + len(eos)
                spans.append((at, end))
            cursor = end
        return tuple(spans)

    def _render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool, where: str) -> str:
        if any(mark in str(message.get("content", "")) for message in messages for mark in (_OPEN, _CLOSE)):
            raise ConfigError(f"data.path: {where or 'a conversation'} holds the characters U+E000 or U+E001, "
                              "which trainfit uses to find the assistant's text; remove them from the record")
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **self.kwargs)
        except ConfigError:
            raise
        except Exception as err:  # Jinja's errors and the template's own raise_exception
            raise ConfigError(f"data.chat_template: {self.origin} failed on {where or 'a conversation'} "
                              f"({type(err).__name__}: {err}); fix the record or choose another template "
                              "(data.chat_template=chatml | llama3 | FILE)") from err


def template_kwargs(text: str) -> dict[str, Any]:
    """data.chat_template_kwargs: a JSON object, or "" for none."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"data.chat_template_kwargs={text!r}: not JSON ({err}); write an object, e.g. "
                          '\'{"enable_thinking": false}\'') from err
    if not isinstance(value, dict):
        raise ConfigError(f"data.chat_template_kwargs={text!r}: a JSON {type(value).__name__}, not an object; write "
                          '\'{"enable_thinking": false}\'')
    return value


def find_chat_template(choice: str, folders: Sequence[str], kwargs: dict[str, Any] | None = None) -> ChatTemplate:
    """`data.chat_template` (a built-in's name, a .jinja file, or "" for the first of `folders` that has
    one: the tokenizer's, then the model's) as a ChatTemplate with that folder's special tokens."""
    special = next((tokens for folder in folders if (tokens := _special_tokens(Path(folder)))), {})
    if choice in BUILT_IN:
        source, own = BUILT_IN[choice]
        return ChatTemplate(source, f"the built-in {choice} template", {**own, **special}, dict(kwargs or {}))
    if choice:
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.chat_template={choice!r}: no such file; name a Jinja file, a built-in "
                              f"({', '.join(BUILT_IN)}) or leave it empty for the model's own")
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path), special, dict(kwargs or {}))
    for folder in folders:
        found = _folder_template(Path(folder))
        if found is not None:
            return ChatTemplate(found[0], found[1], _special_tokens(Path(folder)), dict(kwargs or {}))
    looked = ", ".join(repr(f) for f in folders) or "no folder (data.tokenizer and model.init_from name none)"
    raise ConfigError(f"data.chat_template='': found no chat template in {looked}; a chat dataset needs one: "
                      f"set data.chat_template to a built-in ({', '.join(BUILT_IN)}) or a Jinja file")


SAVED_TOKENS = "chat_template_tokens.json"
"""Beside a saved template (prepared data, a checkpoint): the special tokens it was rendered with."""


def save_chat_template(template: ChatTemplate, directory: Path) -> None:
    """Write `template` where load_saved_chat_template finds it: a run's checkpoints carry the template
    their samples were rendered with, so `trainfit sample --chat` writes prompts the same way."""
    (directory / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    (directory / SAVED_TOKENS).write_text(json.dumps({"origin": template.origin, "special_tokens":
                                                      template.special_tokens, "kwargs": template.kwargs}) + "\n")


def load_saved_chat_template(directory: Path) -> ChatTemplate | None:
    """The template save_chat_template wrote in `directory`, or None."""
    if not (directory / SAVED_TOKENS).is_file() or not (directory / TEMPLATE_FILE).is_file():
        return None
    facts = json.loads((directory / SAVED_TOKENS).read_text())
    return ChatTemplate((directory / TEMPLATE_FILE).read_text(encoding="utf-8"), facts["origin"],
                        facts["special_tokens"], facts.get("kwargs", {}))


def _folder_template(folder: Path) -> tuple[str, str] | None:
    """(template, where) of a model or tokenizer folder, or None."""
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), str(folder / TEMPLATE_FILE)
    config = _tokenizer_config(folder)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates (transformers: [{"name": ..., "template": ...}])
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template, f"{folder / TOKENIZER_CONFIG}'s chat_template"
    return None


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    path = folder / TOKENIZER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({err}); restore the model folder's file") from err
    return config if isinstance(config, dict) else {}


def _special_tokens(folder: Path) -> dict[str, str]:
    """A folder's special tokens as the template sees them: strings (tokenizer_config.json may store
    an added token's {"content": ...})."""
    config = _tokenizer_config(folder)
    tokens = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return tokens


# ---------------------------------------------------------------- rendering


def _compile(source: str, origin: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: the assistant's own text, bracketed by marks that
        render_trained turns into spans."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _OPEN + caller() + _CLOSE

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ConfigError(f"data.chat_template: {origin} is not a valid Jinja template (line {err.lineno}: "
                          f"{err.message}); fix it or choose another (data.chat_template=chatml | llama3 | FILE)"
                          ) from err


def _strip_marks(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")


def _marked_spans(marked: str) -> Rendered:
    """The text without its generation marks, and the spans the marks bracketed."""
    out: list[str] = []
    spans, start, length = [], None, 0
    for piece in _split_marks(marked):
        if piece == _OPEN:
            start = length
        elif piece == _CLOSE:
            if start is not None and length > start:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    return Rendered("".join(out), tuple(spans))


def _split_marks(text: str) -> Iterator[str]:
    yield from (piece for piece in re.split(f"([{_OPEN}{_CLOSE}])", text) if piece)
