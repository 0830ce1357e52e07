from __future__ import annotations

import pytest

from trainfit.config import ConfigError
from trainfit.train.data import default_corpus_text
from trainfit.train.tokenizer import (
    EOT,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer_from_dir,
    resolve_tokenizer,
    train_bpe,
)

SAMPLE = "To be, or not to be: that is the question.\nnaïve café — 東京 🙂\n"


@pytest.fixture(scope="module")
def corpus_slice() -> str:
    return default_corpus_text()[:60_000]


@pytest.fixture(scope="module")
def bpe(corpus_slice: str) -> HFTokenizer:
    return train_bpe([corpus_slice], 400)


def test_bytes_round_trip_and_lossy_decode() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids == list(SAMPLE.encode("utf-8")) and max(ids) < tok.vocab_size == 256
    assert tok.decode(ids) == SAMPLE
    assert tok.encode_batch(["a", "é"]) == [[97], [0xC3, 0xA9]]
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character does not raise
    assert tok.eot_id is None


def test_train_bpe_vocab_and_round_trip(bpe: HFTokenizer, corpus_slice: str) -> None:
    assert bpe.vocab_size == 400 and bpe.name == "bpe-400"
    assert bpe.eot_id == bpe.tokenizer.token_to_id(EOT)
    ids = bpe.encode(corpus_slice)
    assert len(ids) < 0.7 * len(corpus_slice.encode())  # merges learned
    assert max(ids) < bpe.vocab_size
    assert bpe.decode(ids) == corpus_slice
    assert bpe.decode(bpe.encode(SAMPLE)) == SAMPLE  # unseen characters fall back to bytes
    assert bpe.encode_batch([SAMPLE, "x"]) == [bpe.encode(SAMPLE), bpe.encode("x")]


def test_train_bpe_is_deterministic(bpe: HFTokenizer, corpus_slice: str) -> None:
    again = train_bpe(iter([corpus_slice[:30_000], corpus_slice[30_000:]]), 400)
    assert again.tokenizer.get_vocab() == bpe.tokenizer.get_vocab()
    assert again.encode(corpus_slice) == bpe.encode(corpus_slice)


def test_special_token_text_in_documents_is_plain_text(bpe: HFTokenizer) -> None:
    text = f"a {EOT} b"
    ids = bpe.encode(text)
    assert bpe.eot_id not in ids
    assert bpe.decode(ids) == text


def test_train_bpe_rejects_vocab_below_byte_alphabet() -> None:
    with pytest.raises(ConfigError, match="data.bpe_vocab_size=100"):
        train_bpe(["abc"], 100)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_save_and_load_from_dir(kind: str, bpe: HFTokenizer, tmp_path) -> None:
    tok = ByteTokenizer() if kind == "bytes" else bpe
    tok.save(tmp_path / "tok")
    loaded = load_tokenizer_from_dir(tmp_path / "tok")
    assert type(loaded) is type(tok)
    assert loaded.spec() == tok.spec()
    assert (loaded.name, loaded.vocab_size, loaded.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
    assert loaded.encode(SAMPLE) == tok.encode(SAMPLE)
    assert loaded.decode(tok.encode(SAMPLE)) == SAMPLE


def test_load_from_dir_without_tokenizer(tmp_path) -> None:
    with pytest.raises(ConfigError, match="trainfit_tokenizer.json"):
        load_tokenizer_from_dir(tmp_path)


def test_resolve_tokenizer(bpe: HFTokenizer, tmp_path) -> None:
    assert isinstance(resolve_tokenizer("bytes", iter(()), 4096), ByteTokenizer)
    trained = resolve_tokenizer("train", iter(["hello world, hello tokens\n" * 50]), 260)
    assert isinstance(trained, HFTokenizer) and trained.vocab_size == 260
    bpe.save(tmp_path)
    for spec in (str(tmp_path / "tokenizer.json"), str(tmp_path)):  # the file or its folder
        tok = resolve_tokenizer(spec, iter(()), 4096)
        assert tok.name == spec and tok.encode(SAMPLE) == bpe.encode(SAMPLE)


def test_resolve_tokenizer_missing_path(tmp_path) -> None:
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError) as err:
        resolve_tokenizer(missing, iter(()), 4096)
    message = str(err.value)
    assert "data.tokenizer" in message and missing in message and "'bytes'" in message
