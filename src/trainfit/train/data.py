"""Token data: text is tokenized once into memory-mappable files; batches are pure functions of
(seed, position), so a resumed run sees exactly the stream an uninterrupted one would have seen.

A prepared folder holds train.bin and val.bin (raw token ids, uint16 or uint32, native byte order),
the tokenizer's files and manifest.json. Validation is the tail of the token stream.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import hashlib
import json
import lzma
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from trainfit.config import ConfigError, DataConfig
from trainfit.sample_rows import SampleRows, prepared_rows
from trainfit.train.chat_template import (
    find_chat_template,
    load_saved_chat_template,
    save_chat_template,
    template_kwargs,
)
from trainfit.train.records import RECORD_SUFFIXES, detect_format, first_record, read_records, record_files
from trainfit.train.samples import (
    LAYOUT,
    SampleSplit,
    encode_record,
    load_samples,
    sample_eval_batches,
    template_folders,
    write_samples,
)
from trainfit.train.step_rows import StepRows
from trainfit.train.tokenizer import HF_FILE, Tokenizer, load_tokenizer_from_dir, resolve_tokenizer

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
SAMPLES_VERSION = 2
"""Of prepared fine-tuning samples (train/samples.py), in their cache key: 2 saves the chat template."""
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
PACKAGED_CORPUS = "shakespeare.txt.xz"
_PIECE_BYTES = 1 << 16  # text is encoded in ~64 KB pieces cut after a newline ...
_PIECES_PER_CALL = 64  # ... and handed to the tokenizer 64 at a time (HF encodes them in parallel)
_VERIFY_BELOW_BYTES = 100 << 20  # sha256 of smaller data costs well under a second


def default_corpus_text() -> str:
    """The Shakespeare slice shipped with trainfit (about 1.1 MB of text)."""
    return lzma.decompress(_packaged_corpus().read_bytes()).decode("utf-8")


def _packaged_corpus() -> resources.abc.Traversable:
    return resources.files("trainfit") / "assets" / PACKAGED_CORPUS


# ---------------------------------------------------------------- reading text


def _input_files(input_path: str) -> list[Path]:
    """The files `data.path` names, in a fixed order; [] means the packaged corpus."""
    if not input_path:
        return []
    path = Path(input_path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"data.path={input_path!r}: no such file or folder; give a text file, a "
                          'folder of .txt/.jsonl files, prepared data, or "" for the packaged Shakespeare')
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".txt", *RECORD_SUFFIXES))
    if not files:
        raise ConfigError(f"data.path={input_path!r}: the folder holds no .txt, .jsonl, .json or .parquet files; "
                          "add some or point data.path to a text file")
    return files


def fine_tuning_files(files: list[Path], fmt: str) -> bool:
    """Whether `files` are fine-tuning samples (train/samples.py) rather than a text stream: data.format
    names a fine-tuning format, or (auto) a record file's first record has one."""
    if fmt != "auto":
        return fmt != "text"
    for path in record_files(files):
        first = first_record(path)
        if first is not None and detect_format(first[1], first[0]) != "text":
            return True
    return False


def _documents(files: list[Path]) -> Iterator[Iterator[str]]:
    """Each document as an iterator of text pieces: a .txt file is one document, a .jsonl line another."""
    if not files:
        yield _packaged_pieces()
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path)
        elif path.suffix in (".json", ".parquet"):
            yield from (iter([record.text or ""]) for record in read_records(path, "text"))
        else:
            yield _file_pieces(path)


def _packaged_pieces() -> Iterator[str]:
    with _packaged_corpus().open("rb") as raw, lzma.open(raw) as f:
        yield from _pieces(f, PACKAGED_CORPUS)


def _file_pieces(path: Path) -> Iterator[str]:
    with path.open("rb") as f:
        yield from _pieces(f, str(path))


def _pieces(f: BinaryIO, label: str) -> Iterator[str]:
    """Decode a UTF-8 stream in ~64 KB pieces cut after a newline, so no file is ever held whole."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()  # -sig: drop a leading byte-order mark
    text, offset = "", 0
    while block := f.read(_PIECE_BYTES):
        if b"\0" in block:
            raise _not_text(label, "contains NUL bytes")
        try:
            text += decoder.decode(block)
        except UnicodeDecodeError as err:
            raise _not_text(label, f"is not UTF-8 (near byte {offset + err.start})") from err
        offset += len(block)
        # A text without newlines is cut anyway once large, to keep the concatenation linear.
        cut = text.rfind("\n") + 1 or (len(text) if len(text) >= 16 * _PIECE_BYTES else 0)
        if cut:
            yield text[:cut]
            text = text[cut:]
    try:
        text += decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise _not_text(label, "ends inside a UTF-8 character") from err
    if text:
        yield text


def _jsonl_documents(path: Path) -> Iterator[Iterator[str]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            if b"\0" in raw:
                raise _not_text(where, "contains NUL bytes")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ConfigError(f"data.path: {where!r} is not a UTF-8 JSON object ({err}); write one "
                                  'object per line, e.g. {"text": "..."}') from err
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f'data.path: {where!r} has no string "text" field; write one object '
                                  'per line, e.g. {"text": "..."}')
            yield iter([text])


def _not_text(label: str, problem: str) -> ConfigError:
    return ConfigError(f"data.path: {label!r} {problem}, so it looks binary; trainfit reads UTF-8 text "
                       "only: convert the file or remove it from data.path")


# ---------------------------------------------------------------- preparing


def prepare_data(input_path: str, out_dir: str, tokenizer: str = "bytes", bpe_vocab_size: int = 4096,
                 val_fraction: float = 0.05, *, replace: bool = True, fmt: str = "auto", chat_template: str = "",
                 loss_on: str = "completion", template_folders: list[str] | None = None,
                 chat_template_kwargs: str = "") -> dict[str, Any]:
    """Tokenize a corpus once into train.bin/val.bin + tokenizer + manifest.json; returns the manifest.
    Fine-tuning records (data.format, train/samples.py) are prepared as samples, through the chat template
    `chat_template` (or the first of `template_folders` that has one).

    The folder is built in a temporary sibling and renamed, so it appears complete or not at all.
    An existing prepared out_dir is replaced, or kept as it is with replace=False (a concurrent
    preparation of the same data got there first)."""
    if not 0 < val_fraction < 1:
        raise ConfigError(f"data.val_fraction={val_fraction!r}: must be between 0 and 1 (exclusive)")
    files = _input_files(input_path)
    samples = fine_tuning_files(files, fmt)
    if samples and tokenizer == "train":
        raise ConfigError("data.tokenizer='train': fine-tuning records are tokenized with the model's own tokenizer; "
                          "set data.tokenizer to its tokenizer.json (or folder), or 'bytes'")
    tok = resolve_tokenizer(tokenizer, (p for doc in _documents(files) for p in doc), bpe_vocab_size)
    dtype = _token_dtype(tok.vocab_size, tokenizer)
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if samples:
            counts = _write_samples(tmp, tok, files, dtype, val_fraction, input_path, fmt, chat_template, loss_on,
                                    template_folders or [], template_kwargs(chat_template_kwargs))
        else:
            counts = {"num_tokens": _write_splits(tmp, tok, files, dtype, val_fraction, input_path)}
        tok.save(tmp)
        manifest = {
            "format_version": FORMAT_VERSION,
            "source": str(Path(input_path).expanduser().absolute()) if input_path else PACKAGED_CORPUS,
            "tokenizer": tok.spec(),
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "val_fraction": val_fraction,
            **counts,
            "sha256": {split: _sha256(tmp / f"{split}.bin") for split in SPLITS},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _publish(tmp, out, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _write_samples(tmp: Path, tok: Tokenizer, files: list[Path], dtype: np.dtype, val_fraction: float,
                   input_path: str, fmt: str, chat_template: str, loss_on: str,
                   template_folders: list[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every record of `files` encoded (train/samples.py); plain .txt files are refused beside records."""
    text_files = [p.name for p in files if p not in record_files(files)]
    if text_files:
        raise ConfigError(f"data.path={input_path!r}: holds fine-tuning records and plain text "
                          f"({', '.join(text_files)}); put the text in {{\"text\": ...}} records, or keep it in "
                          "another folder")
    template = None

    def encoded() -> Iterator[Any]:
        nonlocal template
        for path in files:
            for record in read_records(path, fmt):
                if record.text is None and template is None:
                    template = find_chat_template(chat_template, template_folders, kwargs)
                yield encode_record(record, tok, template, loss_on)

    counts = write_samples(tmp, encoded(), dtype, val_fraction, input_path)
    if template is not None:
        save_chat_template(template, tmp)
    return {**counts, "loss_on": loss_on, "chat_template": template.origin if template else None}


def _token_dtype(vocab_size: int, tokenizer: str) -> np.dtype:
    for dtype in (np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ConfigError(f"data.tokenizer={tokenizer!r}: its {vocab_size} token ids do not fit in uint32, the "
                      "largest token dtype; use a tokenizer with a smaller vocabulary")


def _write_splits(tmp: Path, tok: Tokenizer, files: list[Path], dtype: np.dtype, val_fraction: float,
                  input_path: str) -> dict[str, int]:
    """Encode every document into one file, then move its tail into val.bin."""
    stream = tmp / "train.bin"
    with stream.open("wb") as f:
        total = _encode_documents(tok, _documents(files), f, dtype)
    if total == 0:
        raise ConfigError(f"data.path={input_path!r}: found no text (empty file or folder); give some text")
    num_val = round(total * val_fraction)
    num_train = total - num_val
    if min(num_train, num_val) < 2:
        raise ConfigError(f"data.val_fraction={val_fraction!r}: {total} tokens split into {num_train} "
                          f"train / {num_val} validation tokens, and each split needs at least 2 (and "
                          "training.seq_len + 1 to be used); use more text (data.path) or adjust "
                          "data.val_fraction")
    tokens = np.memmap(stream, dtype=dtype, mode="r")
    tokens[num_train:].tofile(tmp / "val.bin")
    del tokens  # unmap before truncating
    os.truncate(stream, num_train * dtype.itemsize)
    return {"train": num_train, "val": num_val}


def _encode_documents(tok: Tokenizer, documents: Iterable[Iterable[str]], f: BinaryIO,
                      dtype: np.dtype) -> int:
    """Write all token ids to f, with a separator between documents; returns the token count."""
    separator = np.asarray([tok.eot_id] if tok.eot_id is not None else tok.encode("\n\n"), dtype)
    pieces = ((i, piece) for i, doc in enumerate(documents) for piece in doc if piece)
    total, last_doc = 0, 0
    while group := list(islice(pieces, _PIECES_PER_CALL)):
        arrays = []
        for (doc, _), ids in zip(group, tok.encode_batch([piece for _, piece in group]), strict=True):
            if doc != last_doc and (total or arrays):
                arrays.append(separator)
            last_doc = doc
            arrays.append(np.asarray(ids, dtype))
        chunk = np.concatenate(arrays)
        chunk.tofile(f)
        total += chunk.size
    return total


def _publish(tmp: Path, out: Path, replace: bool) -> None:
    """Rename the finished folder into place. Only prepared data or an empty folder is replaced;
    prepared data that appears meanwhile (a concurrent preparation) is kept."""
    old = tmp.with_name(tmp.name + ".old")
    if replace and (out / MANIFEST).is_file():
        os.rename(out, old)
    try:
        os.rename(tmp, out)  # atomic; fails if out is a file or a non-empty folder
    except OSError as err:
        if not (out / MANIFEST).is_file():
            raise ConfigError(f"out_dir={str(out)!r}: exists and holds no prepared data; choose a new "
                              "or empty folder") from err
    finally:
        shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------- loading


@dataclass
class TokenData:
    """Memory-mapped token splits with the tokenizer that produced them."""

    train: np.ndarray | SampleSplit
    val: np.ndarray | SampleSplit
    """A text corpus's token streams, or fine-tuning samples (train/samples.py)."""
    tokenizer: Tokenizer
    manifest: dict[str, Any]

    root: Path | None = None
    """The prepared folder."""

    @property
    def samples(self) -> bool:
        return isinstance(self.train, SampleSplit)

    def save_extras(self, directory: str | os.PathLike[str]) -> None:
        """What a checkpoint carries beside the weights: the tokenizer, and the chat template the samples
        were rendered with (train/chat_template.py)."""
        self.tokenizer.save(directory)
        template = load_saved_chat_template(self.root) if self.root is not None else None
        if template is not None:
            save_chat_template(template, Path(directory))


def load_prepared(directory: str | os.PathLike[str], verify: bool | None = None) -> TokenData:
    """Memory-map prepared data after checking it against its manifest: sizes always, sha256
    when verify is True (default: only when the data is under 100 MB)."""
    root = Path(directory).expanduser()
    if not (root / MANIFEST).is_file():
        raise ConfigError(f"data.path={str(root)!r}: no {MANIFEST}, so not prepared data; run "
                          "`trainfit prepare-data` into it or point data.path to the text instead")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _damaged(root, f"its {MANIFEST} is not valid JSON ({err})") from err
    if not isinstance(manifest, dict):
        raise _damaged(root, f"its {MANIFEST} holds a {type(manifest).__name__}, not a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"data.path={str(root)!r}: prepared with format {manifest.get('format_version')}, "
                          f"this trainfit reads format {FORMAT_VERSION}; prepare the data again")
    missing = [key for key in ("dtype", "num_tokens", "sha256", "vocab_size") if key not in manifest]
    if missing:
        raise _damaged(root, f"its {MANIFEST} lacks {', '.join(missing)}")
    dtype = np.dtype(manifest["dtype"])
    if manifest.get("layout") == LAYOUT:
        splits = load_samples(root, manifest, dtype)
        tokenizer = load_tokenizer_from_dir(root)
        return TokenData(splits["train"], splits["val"], tokenizer, manifest, root)
    paths = {split: root / f"{split}.bin" for split in SPLITS}
    sizes = {split: path.stat().st_size if path.is_file() else -1 for split, path in paths.items()}
    if verify is None:
        verify = sum(sizes.values()) < _VERIFY_BELOW_BYTES
    for split, path in paths.items():
        if sizes[split] != manifest["num_tokens"][split] * dtype.itemsize:
            raise _damaged(root, f"{path.name} is missing or has the wrong size")
        if verify and _sha256(path) != manifest["sha256"][split]:
            raise _damaged(root, f"{path.name} does not match its sha256")
    tokenizer = load_tokenizer_from_dir(root)
    if tokenizer.vocab_size != manifest["vocab_size"]:
        raise _damaged(root, "the tokenizer's vocabulary differs from the manifest")
    arrays = {split: np.memmap(path, dtype=dtype, mode="r") for split, path in paths.items()}
    return TokenData(arrays["train"], arrays["val"], tokenizer, manifest, root)


def _damaged(root: Path, problem: str) -> ConfigError:
    return ConfigError(f"data.path={str(root)!r}: {problem}; the folder is damaged: delete it and prepare "
                       "the data again (a cache folder is rebuilt on the next run)")


def data_cache_dir() -> Path:
    """Where runs keep the data they tokenized (one entry per _cache_key)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trainfit" / "data"


def sample_rows_of(cfg: DataConfig, model_folder: str = "", cache_dir: str | None = None) -> SampleRows | None:
    """What the run's rows hold (sample_rows.py) without tokenizing anything: None for a text stream (or a
    data.path that is not there: the run says so); fine-tuning samples' length statistics from data.path's
    manifest when it is prepared, else from the cache entry a run already made, else unknown lengths.
    Looked up once per data setting and file version (the planner asks per candidate)."""
    if not cfg.path:
        return None
    try:
        stamp = Path(cfg.path).expanduser().stat().st_mtime_ns
    except OSError:
        return None
    cache = str(Path(cache_dir or data_cache_dir()).expanduser())
    manifest = _samples_manifest(tuple(dataclasses.astuple(cfg)), model_folder, cache, stamp)
    if manifest is None:
        return None
    if not manifest.is_file():  # records a run has not tokenized yet
        return SampleRows(cfg.packing)
    return prepared_rows(str(manifest.parent), cfg.packing)


@functools.lru_cache(maxsize=64)
def _samples_manifest(fields: tuple[Any, ...], model_folder: str, cache_dir: str, stamp: int) -> Path | None:
    """The manifest fine-tuning samples of the data setting `fields` are (or will be) prepared under; None for
    text (or data that is not readable: the run names why)."""
    del stamp  # the key's part that makes an edited data.path looked up again
    cfg = DataConfig(*fields)
    root = Path(cfg.path).expanduser()
    try:
        if (root / MANIFEST).is_file():
            return root / MANIFEST
        files = _input_files(cfg.path)
        if not fine_tuning_files(files, cfg.format):
            return None
        return Path(cache_dir) / _cache_key(cfg, template_folders(cfg.tokenizer, model_folder)) / MANIFEST
    except (ConfigError, OSError, ValueError):
        return None


def resolve_data(cfg: DataConfig, cache_dir: str, model_folder: str = "") -> TokenData:
    """The run's tokens: data.path itself when it holds prepared data, else a cache entry keyed by
    everything that changes the tokens, prepared by the first run and reused by the next ones.
    `model_folder` (model.init_from): where a chat template is looked for after the tokenizer's folder."""
    if cfg.path and (Path(cfg.path).expanduser() / MANIFEST).is_file():
        data = load_prepared(cfg.path)
        _warn_ignored(cfg, data.manifest)
        return data
    folders = template_folders(cfg.tokenizer, model_folder)
    target = Path(cache_dir).expanduser() / _cache_key(cfg, folders)
    if not (target / MANIFEST).is_file():
        prepare_data(cfg.path, str(target), cfg.tokenizer, cfg.bpe_vocab_size, cfg.val_fraction,
                     replace=False, fmt=cfg.format, chat_template=cfg.chat_template, loss_on=cfg.loss_on,
                     template_folders=folders, chat_template_kwargs=cfg.chat_template_kwargs)
    return load_prepared(target)


def _cache_key(cfg: DataConfig, folders: list[str] | None = None) -> str:
    """<name>-<hash of the input files' paths, sizes and mtimes and of the tokenizer settings>."""
    files = _input_files(cfg.path)
    if files:
        inputs: list[Any] = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    else:
        inputs = ["packaged", hashlib.sha256(_packaged_corpus().read_bytes()).hexdigest()]
    tokenizer: Any = cfg.tokenizer
    if cfg.tokenizer == "train":
        tokenizer = ["train", cfg.bpe_vocab_size]
    elif cfg.tokenizer != "bytes":
        path = Path(cfg.tokenizer).expanduser()
        path = path / HF_FILE if path.is_dir() else path
        if path.is_file():
            tokenizer = [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns]
    key: list[Any] = [FORMAT_VERSION, inputs, tokenizer, cfg.val_fraction]
    if files and fine_tuning_files(files, cfg.format):  # what renders and masks the samples
        templates = [_file_stamp(Path(cfg.chat_template).expanduser())] if cfg.chat_template else \
            [_file_stamp(Path(folder) / name) for folder in folders or []
             for name in ("chat_template.jinja", "tokenizer_config.json")]
        key += [SAMPLES_VERSION, cfg.format, cfg.chat_template, cfg.loss_on, templates, cfg.chat_template_kwargs]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    name = Path(cfg.path).expanduser().absolute().stem if cfg.path else "shakespeare"
    return f"{name}-{digest}"


def _file_stamp(path: Path) -> list[Any]:
    return [str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns] if path.is_file() else [str(path)]


def _warn_ignored(cfg: DataConfig, manifest: dict[str, Any]) -> None:
    wanted = f"bpe-{cfg.bpe_vocab_size}" if cfg.tokenizer == "train" else cfg.tokenizer
    name = manifest["tokenizer"]["name"]
    if name != wanted or manifest["val_fraction"] != cfg.val_fraction:
        warnings.warn(f"data.path={cfg.path!r} holds prepared data (tokenizer {name!r}, val_fraction "
                      f"{manifest['val_fraction']}); data.tokenizer and data.val_fraction have no effect",
                      stacklevel=3)


# ---------------------------------------------------------------- batches


class BatchSampler(StepRows):
    """Random windows of seq_len + 1 tokens, drawn per step as StepRows draws (train/step_rows.py)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, grad_accum_steps: int = 1) -> None:
        _check_length(tokens, seq_len, "train")
        super().__init__(batch_size, seed, rank, world_size, grad_accum_steps)
        self.tokens, self.seq_len = tokens, seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (batch_size, seq_len); targets are inputs shifted by one."""
        return _gather(self.tokens, self.next_rows(len(self.tokens) - self.seq_len), self.seq_len)


def eval_batches(tokens: np.ndarray | SampleSplit, seq_len: int, batch_size: int, num_batches: int,
                 pad_id: int = 0, packing: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """Evenly spaced fixed windows over the validation split (fine-tuning samples: the validation samples'
    rows, packed when `packing`, train/samples.py): the same batches at every evaluation, so successive
    validation losses differ only because the model changed."""
    if isinstance(tokens, SampleSplit):
        return sample_eval_batches(tokens, seq_len, batch_size, num_batches, pad_id, packing)
    _check_length(tokens, seq_len, "validation")
    starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * batch_size).round().astype(np.int64)
    return (_gather(tokens, starts[i:i + batch_size], seq_len) for i in range(0, len(starts), batch_size))


def _check_length(tokens: np.ndarray, seq_len: int, split: str) -> None:
    if len(tokens) < seq_len + 1:
        more = "more text (data.path) or a larger data.val_fraction" if split == "validation" else \
            "more text (data.path)"
        raise ConfigError(f"training.seq_len={seq_len}: the {split} split has only {len(tokens)} tokens, "
                          f"fewer than seq_len + 1; use a shorter training.seq_len or {more}")


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch  # only here: preparing data stays torch-free

    windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    return torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
