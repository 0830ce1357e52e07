from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import trainfit.train.data as data_mod
from trainfit.config import ConfigError, DataConfig
from trainfit.train.data import (
    BatchSampler,
    default_corpus_text,
    eval_batches,
    load_prepared,
    prepare_data,
    resolve_data,
)
from trainfit.train.tokenizer import ByteTokenizer, train_bpe

TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400))


def _bins(out: Path, manifest: dict) -> dict[str, np.ndarray]:
    return {split: np.fromfile(out / f"{split}.bin", dtype=manifest["dtype"]) for split in ("train", "val")}


def _check_manifest(out: Path, manifest: dict) -> np.ndarray:
    """Counts match the file sizes and checksums match; returns train + val concatenated."""
    assert json.loads((out / "manifest.json").read_text()) == manifest
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in ("train", "val"):
        raw = (out / f"{split}.bin").read_bytes()
        assert len(raw) == manifest["num_tokens"][split] * itemsize
        assert hashlib.sha256(raw).hexdigest() == manifest["sha256"][split]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    bins = _bins(out, manifest)
    return np.concatenate([bins["train"], bins["val"]])


def test_prepare_text_file(tmp_path) -> None:
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    manifest = prepare_data(str(src), str(tmp_path / "out"), val_fraction=0.1)
    tokens = _check_manifest(tmp_path / "out", manifest)
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 256
    assert manifest["source"] == str(src) and manifest["tokenizer"]["kind"] == "bytes"
    assert tokens.tobytes() == np.frombuffer(TEXT.encode(), np.uint8).astype(np.uint16).tobytes()
    assert manifest["num_tokens"]["val"] == round(len(TEXT) * 0.1)  # val is the tail
    data = load_prepared(tmp_path / "out")
    assert isinstance(data.train, np.memmap) and isinstance(data.tokenizer, ByteTokenizer)
    assert data.tokenizer.decode(np.concatenate([data.train, data.val]).tolist()) == TEXT


def test_prepare_folder_txt_and_jsonl(tmp_path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 3}\n{"text": ""}\n')
    (folder / "a.txt").write_text("\ufefffirst")  # a byte-order mark is not text
    (folder / "c.txt").write_text("")  # empty documents add no separator
    (folder / "notes.md").write_text("ignored")
    manifest = prepare_data(str(folder), str(tmp_path / "out"), val_fraction=0.2)
    tokens = _check_manifest(tmp_path / "out", manifest)
    assert bytes(tokens.astype(np.uint8)) == b"first\n\nsecond\n\nthird"


def test_prepare_folder_with_bpe_separates_documents_with_eot(tmp_path) -> None:
    tok = train_bpe([TEXT], 300)
    tok.save(tmp_path / "tok")
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT[:5000])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": TEXT[i:i + 500]}) + "\n"
                                            for i in range(0, 3000, 500)))
    manifest = prepare_data(str(folder), str(tmp_path / "out"), tokenizer=str(tmp_path / "tok"))
    tokens = _check_manifest(tmp_path / "out", manifest)
    assert manifest["vocab_size"] == 300 and manifest["tokenizer"]["kind"] == "hf"
    assert int((tokens == tok.eot_id).sum()) == 6  # 7 documents
    pieces = tok.decode(tokens.tolist()).split("<|endoftext|>")
    assert pieces == [TEXT[:5000]] + [TEXT[i:i + 500] for i in range(0, 3000, 500)]


def test_prepare_packaged_corpus(tmp_path) -> None:
    text = default_corpus_text()
    assert 1_000_000 < len(text) < 1_200_000 and text.endswith("\n")
    manifest = prepare_data("", str(tmp_path / "out"))
    tokens = _check_manifest(tmp_path / "out", manifest)
    assert sum(manifest["num_tokens"].values()) == len(text.encode())
    assert tokens[-manifest["num_tokens"]["val"]:].tobytes() == \
        np.frombuffer(text.encode()[-manifest["num_tokens"]["val"]:], np.uint8).astype(np.uint16).tobytes()


def test_prepare_replaces_prepared_out_dir_but_not_other_folders(tmp_path) -> None:
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    out = tmp_path / "out"
    prepare_data(str(src), str(out))
    src.write_text(TEXT[:2000])
    assert prepare_data(str(src), str(out))["num_tokens"]["train"] == 1900
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="out_dir"):
        prepare_data(str(src), str(other))
    assert (other / "keep.txt").read_text() == "mine"


def _write(path: Path, content: bytes | str) -> str:
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return str(path)


# case: (files to create, the data.path to pass ("" = the folder), expected words)
BAD_INPUTS = {
    "missing": ({}, "absent.txt", "no such file"),
    "empty_file": ({"e.txt": b""}, "e.txt", "no text"),
    "no_txt_in_folder": ({"x.csv": b"a,b"}, "", "no .txt, .jsonl, .json or .parquet"),
    "empty_files_in_folder": ({"e.txt": b"", "f.jsonl": b"\n"}, "", "no text"),
    "nul": ({"b.txt": b"abc\x00def"}, "b.txt", "NUL"),
    "not_utf8": ({"b.txt": b"ok\n\xff\xfe latin-1 \xe9"}, "b.txt", "not UTF-8"),
    "bad_jsonl": ({"d.jsonl": b'{"text": "a"}\nnot json\n'}, "d.jsonl", "d.jsonl:2.*JSON"),
    "jsonl_no_text": ({"d.jsonl": b'{"body": "a"}\n'}, "d.jsonl", '"text"'),
    "too_few_tokens": ({"t.txt": b"abc"}, "t.txt", "data.val_fraction=0.05: 3 tokens"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_prepare_errors_name_the_path(case: str, tmp_path) -> None:
    files, target, needle = BAD_INPUTS[case]
    root = tmp_path / "in"
    root.mkdir()
    for name, content in files.items():
        _write(root / name, content)
    with pytest.raises(ConfigError, match=needle) as err:
        prepare_data(str(root / target) if target else str(root), str(tmp_path / "out"))
    assert "data." in str(err.value)
    if case != "too_few_tokens":
        assert str(root) in str(err.value)
    assert not (tmp_path / "out").exists()


def test_prepare_errors_on_settings(tmp_path, monkeypatch) -> None:
    src = _write(tmp_path / "a.txt", TEXT)
    with pytest.raises(ConfigError, match="data.val_fraction=1.5"):
        prepare_data(src, str(tmp_path / "out"), val_fraction=1.5)
    with pytest.raises(ConfigError, match="data.tokenizer='/no/such/tokenizer.json'"):
        prepare_data(src, str(tmp_path / "out"), tokenizer="/no/such/tokenizer.json")

    class Huge(ByteTokenizer):
        vocab_size = 2**32 + 1

    monkeypatch.setattr(data_mod, "resolve_tokenizer", lambda *args: Huge())
    with pytest.raises(ConfigError, match="data.tokenizer='bytes'.*uint32"):
        prepare_data(src, str(tmp_path / "out"))


def test_load_prepared_detects_damage(tmp_path) -> None:
    out = tmp_path / "out"
    prepare_data(_write(tmp_path / "a.txt", TEXT), str(out))
    raw = bytearray((out / "val.bin").read_bytes())
    raw[0] ^= 1
    (out / "val.bin").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="val.bin does not match its sha256"):
        load_prepared(out)
    load_prepared(out, verify=False)  # sizes still agree
    (out / "train.bin").write_bytes(b"12")
    with pytest.raises(ConfigError, match="train.bin is missing or has the wrong size"):
        load_prepared(out, verify=False)
    with pytest.raises(ConfigError, match="data.path=.*manifest.json"):
        load_prepared(tmp_path)


def test_resolve_data_prepares_once_and_reuses(tmp_path, monkeypatch) -> None:
    src = _write(tmp_path / "corpus.txt", TEXT)
    cfg = DataConfig(path=src, val_fraction=0.1)
    first = resolve_data(cfg, str(tmp_path / "cache"))
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.name.startswith("corpus-")
    calls = []
    real = data_mod.prepare_data
    monkeypatch.setattr(data_mod, "prepare_data", lambda *a, **k: calls.append(a) or real(*a, **k))
    second = resolve_data(cfg, str(tmp_path / "cache"))
    assert calls == [] and second.manifest == first.manifest
    os.utime(src, ns=(0, 10**9))  # a changed input (mtime) is prepared again, beside the old entry
    resolve_data(cfg, str(tmp_path / "cache"))
    resolve_data(DataConfig(path=src, val_fraction=0.2), str(tmp_path / "cache"))
    assert len(calls) == 2 and len(list((tmp_path / "cache").iterdir())) == 3


def test_resolve_data_loads_prepared_folder(tmp_path) -> None:
    out = tmp_path / "prepared"
    prepare_data(_write(tmp_path / "a.txt", TEXT), str(out))
    data = resolve_data(DataConfig(path=str(out)), str(tmp_path / "cache"))
    assert len(data.train) == data.manifest["num_tokens"]["train"] and not (tmp_path / "cache").exists()
    with pytest.warns(UserWarning, match="data.tokenizer and data.val_fraction have no effect"):
        resolve_data(DataConfig(path=str(out), val_fraction=0.3), str(tmp_path / "cache"))


def test_concurrent_preparation_of_one_target(tmp_path) -> None:
    src = _write(tmp_path / "a.txt", TEXT * 5)
    target = tmp_path / "cache" / "entry"
    errors = []

    def run() -> None:
        try:
            prepare_data(src, str(target), replace=False)
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["entry"]
    load_prepared(target, verify=True)


# ---------------------------------------------------------------- sampling


def test_sampler_batches_are_shifted_windows() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = BatchSampler(tokens, seq_len=16, batch_size=4, seed=0)
    inputs, targets = sampler.next_batch()
    assert inputs.shape == targets.shape == (4, 16) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets, inputs + 1)  # consecutive tokens, shifted by one
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(targets.max()) < 1000
    assert sampler.state_dict() == {"position": 1, "seed": 0}


def test_sampler_resumes_exactly() -> None:
    tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16)
    fresh = BatchSampler(tokens, 32, 8, seed=7)
    for _ in range(5):
        fresh.next_batch()
    state = fresh.state_dict()
    restored = BatchSampler(tokens, 32, 8, seed=7)
    restored.load_state_dict(state)
    for _ in range(3):
        a, b = fresh.next_batch(), restored.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other_seed = BatchSampler(tokens, 32, 8, seed=8)
    assert not torch.equal(other_seed.next_batch()[0], BatchSampler(tokens, 32, 8, seed=7).next_batch()[0])
    with pytest.raises(ConfigError, match="training.seed=8.*seed 7"):
        other_seed.load_state_dict(state)


def test_sampler_ranks_split_the_global_batch() -> None:
    tokens = np.arange(10_000, dtype=np.uint32)
    single = BatchSampler(tokens, 8, 6, seed=3)
    ranks = [BatchSampler(tokens, 8, 2, seed=3, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        inputs, targets = single.next_batch()
        parts = [r.next_batch() for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)


def test_sampler_step_data_is_independent_of_accumulation_and_ranks() -> None:
    """A step's global batch is the same rows whether drawn as 1x8, 4 micro-batches of 2, or 2 ranks x 2 x 2."""
    tokens = np.arange(10_000, dtype=np.uint32)
    whole = BatchSampler(tokens, 8, 8, seed=5)
    accumulated = BatchSampler(tokens, 8, 2, seed=5, grad_accum_steps=4)
    ranks = [BatchSampler(tokens, 8, 2, seed=5, rank=r, world_size=2, grad_accum_steps=2) for r in range(2)]
    for _ in range(3):
        expected = whole.next_batch()[0]
        assert torch.equal(torch.cat([accumulated.next_batch()[0] for _ in range(4)]), expected)
        per_micro = [[r.next_batch()[0] for r in ranks] for _ in range(2)]
        assert torch.equal(torch.cat([t for micro in per_micro for t in micro]), expected)


def test_sampler_and_eval_reject_short_splits() -> None:
    tokens = np.arange(10, dtype=np.uint16)
    with pytest.raises(ConfigError, match="training.seq_len=10.*train split has only 10"):
        BatchSampler(tokens, 10, 1, seed=0)
    BatchSampler(tokens, 9, 1, seed=0).next_batch()
    with pytest.raises(ConfigError, match="validation split.*data.val_fraction"):
        eval_batches(tokens, 10, 1, 1)
    with pytest.raises(ConfigError, match="training.seed=-1"):
        BatchSampler(tokens, 4, 1, seed=-1)


def test_eval_batches_are_fixed_and_span_the_split() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    first = list(eval_batches(tokens, 10, 4, 3))
    second = list(eval_batches(tokens, 10, 4, 3))
    assert len(first) == 3
    for (a, b), (c, d) in zip(first, second, strict=True):
        assert torch.equal(a, c) and torch.equal(b, d) and torch.equal(b, a + 1)
    starts = torch.cat([inputs[:, 0] for inputs, _ in first])
    assert starts[0] == 0 and starts[-1] == 1000 - 11  # the last window ends on the last token
    gaps = starts.diff()
    assert int(gaps.max() - gaps.min()) <= 1  # evenly spaced


def test_prepare_with_trained_bpe_round_trips(tmp_path) -> None:
    manifest = prepare_data(_write(tmp_path / "a.txt", TEXT), str(tmp_path / "out"), tokenizer="train",
                            bpe_vocab_size=300)
    tokens = _check_manifest(tmp_path / "out", manifest)
    assert manifest["vocab_size"] == 300 and manifest["tokenizer"]["name"] == "bpe-300"
    assert len(tokens) < len(TEXT) / 2
    data = load_prepared(tmp_path / "out")
    assert data.tokenizer.decode(tokens.tolist()) == TEXT
