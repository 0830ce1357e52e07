"""Tokenizers: raw UTF-8 bytes, any Hugging Face tokenizer.json, or a byte-level BPE fit on the corpus.

Every tokenizer can `save(dir)` itself beside the prepared tokens (or a checkpoint) and be rebuilt
with `load_tokenizer_from_dir(dir)`, so a run never depends on the file it was first built from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as _HFTokenizerModel
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainfit.config import ConfigError

SPEC_FILE = "trainfit_tokenizer.json"
HF_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
# End-of-document tokens of common tokenizer families, in the order they are looked for.
_EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int | None
    """Token separating documents in the prepared stream; None when the tokenizer has none."""

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A chat template's text: its special tokens' text as the special tokens (as transformers'
        apply_chat_template tokenizes it), with each token's [start, end) characters."""
        ...

    def spec(self) -> dict[str, Any]: ...

    def save(self, directory: str | os.PathLike[str]) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, works for any text."""

    name = "bytes"
    vocab_size = 256
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: list[int]) -> str:
        # A model can emit a cut multi-byte sequence; show it as U+FFFD instead of failing.
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets = [], []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids.extend(encoded)
            offsets.extend([(i, i + 1)] * len(encoded))
        return ids, offsets

    def spec(self) -> dict[str, Any]:
        return {"kind": "bytes", "name": self.name, "vocab_size": self.vocab_size}

    def save(self, directory: str | os.PathLike[str]) -> None:
        _write_spec(Path(directory), self.spec())


class HFTokenizer:
    """A `tokenizers.Tokenizer`; special-token text inside documents is encoded as plain text,
    so only the separators trainfit inserts become end-of-text tokens."""

    def __init__(self, tokenizer: _HFTokenizerModel, name: str) -> None:
        self.tokenizer = tokenizer
        self.tokenizer.encode_special_tokens = True
        self.name = name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        found = (tokenizer.token_to_id(token) for token in _EOT_CANDIDATES)
        self.eot_id = next((i for i in found if i is not None), None)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], name: str | None = None) -> HFTokenizer:
        """Load a tokenizer.json; a malformed one is a ConfigError naming the file."""
        try:
            model = _HFTokenizerModel.from_file(str(path))
        except Exception as err:  # the tokenizers library raises its own Exception subclass
            raise ConfigError(f"data.tokenizer: {str(path)!r} is not a Hugging Face tokenizer.json "
                              f"({str(err).splitlines()[0][:200]}); give a tokenizer.json saved by the tokenizers "
                              "library, 'bytes' or 'train'") from err
        return cls(model, name or str(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # Multi-threaded in Rust: several times faster than encoding one long string.
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        self.tokenizer.encode_special_tokens = False
        try:
            encoding = self.tokenizer.encode(text, add_special_tokens=False)
        finally:
            self.tokenizer.encode_special_tokens = True
        return encoding.ids, list(encoding.offsets)

    def spec(self) -> dict[str, Any]:
        return {"kind": "hf", "name": self.name, "vocab_size": self.vocab_size, "file": HF_FILE}

    def save(self, directory: str | os.PathLike[str]) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / HF_FILE))
        _write_spec(directory, self.spec())


def train_bpe(text_iter: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Fit a byte-level BPE (GPT-2 style: every byte is in the alphabet, so nothing is ever unknown).
    The result is a deterministic function of the text and vocab_size."""
    floor = len(pre_tokenizers.ByteLevel.alphabet()) + 1  # bytes + end-of-text
    if vocab_size < floor:
        raise ConfigError(f"data.bpe_vocab_size={vocab_size}: must be at least {floor} "
                          "(256 byte symbols + the end-of-text token)")
    tokenizer = _HFTokenizerModel(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text_iter, trainer=trainer)
    return HFTokenizer(tokenizer, f"bpe-{vocab_size}")


def resolve_tokenizer(spec: str, corpus_text_iter: Iterable[str], bpe_vocab_size: int) -> Tokenizer:
    """`data.tokenizer` -> a tokenizer; the corpus is only read when spec is "train"."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "train":
        return train_bpe(corpus_text_iter, bpe_vocab_size)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / HF_FILE
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={spec!r}: no tokenizer.json at {str(path)!r}; use 'bytes', "
                          "'train' (fit a BPE on the corpus), or the path of a Hugging Face tokenizer.json "
                          "(or of the folder holding it)")
    return HFTokenizer.from_file(path, name=spec)


def load_tokenizer_from_dir(directory: str | os.PathLike[str]) -> Tokenizer:
    """Rebuild the tokenizer that `save(directory)` wrote."""
    directory = Path(directory)
    spec_path = directory / SPEC_FILE
    if not spec_path.is_file():
        raise ConfigError(f"{str(directory)!r} holds no {SPEC_FILE}: point to prepared data or a "
                          "checkpoint written by trainfit, or prepare the data again")
    try:
        spec = json.loads(spec_path.read_text())
        if spec["kind"] == "bytes":
            return ByteTokenizer()
        return HFTokenizer.from_file(directory / spec["file"], name=spec["name"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise ConfigError(f"{str(spec_path)!r} is damaged ({type(err).__name__}: {err}); prepare the data again "
                          "(or, in a checkpoint, restore the file from the run's data folder)") from err


def _write_spec(directory: Path, spec: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
