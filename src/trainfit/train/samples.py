"""Fine-tuning samples: each record (train/records.py) as token ids and the tokens its loss trains on,
prepared once into memory-mappable files, and batched one sample a row.

A sample's text is its chat template's (train/chat_template.py) or its own (text, string prompt-
completion), tokenized as transformers' apply_chat_template tokenizes a template's text (special
tokens recognised, none added). `data.loss_on=completion` trains on the assistant turns (their
content and end-of-turn token) or the completion; `all` on every token. A prepared folder of samples
holds, per split, the ids (`<split>.bin`), one byte a token saying whether the loss predicts it
(`<split>.mask`) and the samples' boundaries (`<split>.idx`, int64 offsets). Validation is a held-out
set of whole samples: every k-th, k = round(1 / data.val_fraction).

Batches: a row holds whole samples, each cut at seq_len + 1 tokens, packed several a row or one a row
(data.packing; train/packing.py plans which), and padded; a target the loss does not train on (the prompt,
padding) is IGNORE, which the loss leaves out of its mean. Packed rows come with their document ids (which
sample each position holds, -1 for padding), from which the model restarts positions and masks attention.
The rows of optimizer step k are drawn from default_rng([seed, k]) as BatchSampler draws its windows, so
resume is exact and the data of a step does not depend on the micro-batch size, accumulation or world
size. Torch-free but for the batches' tensors.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainfit.config import ConfigError
from trainfit.models.architecture import document_mask_kernel
from trainfit.sample_rows import SAMPLES_LAYOUT
from trainfit.train.chat_template import ChatTemplate
from trainfit.train.packing import RowPlan, plan_rows, sample_positions
from trainfit.train.records import Record
from trainfit.train.step_rows import StepRows
from trainfit.train.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from trainfit.parallel.layout import Layout

IGNORE = -100
"""The target the loss skips (torch's cross_entropy default ignore_index)."""
LAYOUT = SAMPLES_LAYOUT
LOSS_ON = ("completion", "all")


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    trained: np.ndarray
    """bool per token: the loss predicts it (it is a target)."""


def encode_record(record: Record, tok: Tokenizer, template: ChatTemplate | None, loss_on: str) -> Encoded:
    """A record's token ids and trained tokens (module docstring). A text ends with the tokenizer's
    end-of-text token where it has one (trained), so the model learns where a sample stops."""
    if record.text is not None:
        ids, offsets = tok.encode_rendered(record.text)
        start = 0 if loss_on == "all" else record.text_trained_from
        trained = [begin >= start for begin, _ in offsets]
        if tok.eot_id is not None:
            ids, trained = [*ids, tok.eot_id], [*trained, True]
    else:
        if template is None:
            raise ConfigError(f"data.chat_template: {record.where!r} is a conversation, and no chat template was "
                              "found; set data.chat_template")
        rendered = template.render_trained(record.messages, record.where)
        spans = rendered.trained
        if record.trained_from:  # a conversational prompt-completion: the completion's turns only
            asked = len(template.render(record.messages[:record.trained_from], add_generation_prompt=True,
                                        where=record.where))
            spans = tuple(span for span in spans if span[0] >= asked)
        ids, offsets = tok.encode_rendered(rendered.text)
        trained = [loss_on == "all" or any(begin < stop and start < end for start, stop in spans)
                   for begin, end in offsets]  # a token with any character of an assistant span
    out = Encoded(np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool))
    if len(out.ids) < 2 or not out.trained[1:].any():
        raise ConfigError(f"data.path: {record.where!r} has no token to train on (data.loss_on={loss_on}); give "
                          "the record an answer, or remove it")
    return out


def write_samples(directory: Path, encoded: Iterable[Encoded], dtype: np.dtype, val_fraction: float,
                  where: str) -> dict[str, Any]:
    """Write the splits (module docstring); returns the manifest's counts."""
    every = max(2, round(1 / val_fraction))
    files = {split: {kind: (directory / f"{split}.{kind}").open("wb") for kind in ("bin", "mask")}
             for split in ("train", "val")}
    offsets: dict[str, list[int]] = {"train": [0], "val": [0]}
    trained = {"train": 0, "val": 0}
    longest = 0
    try:
        for i, sample in enumerate(encoded):
            split = "val" if i % every == every - 1 else "train"
            sample.ids.astype(dtype).tofile(files[split]["bin"])
            sample.trained.astype(np.uint8).tofile(files[split]["mask"])
            offsets[split].append(offsets[split][-1] + len(sample.ids))
            trained[split] += int(sample.trained.sum())
            longest = max(longest, len(sample.ids))
    finally:
        for handles in files.values():
            for handle in handles.values():
                handle.close()
    counts = {split: len(offsets[split]) - 1 for split in offsets}
    if min(counts.values()) < 1:
        raise ConfigError(f"data.path={where!r}: {sum(counts.values())} samples split into {counts['train']} "
                          f"train / {counts['val']} validation (every {every}th held out, data.val_fraction="
                          f"{val_fraction}); each split needs one: use more records or a larger data.val_fraction")
    for split, bounds in offsets.items():
        np.asarray(bounds, dtype=np.int64).tofile(directory / f"{split}.idx")
    return {"layout": LAYOUT, "num_samples": counts, "num_tokens": {s: offsets[s][-1] for s in offsets},
            "trained_tokens": trained, "longest_sample": longest,
            "lengths": {split: length_statistics(np.diff(np.asarray(bounds, dtype=np.int64)))
                        for split, bounds in offsets.items()}}


def length_statistics(lengths: np.ndarray) -> dict[str, float]:
    """A split's sample lengths (tokens) as the manifest records them: what attention over packed or padded
    rows costs depends on (the sum of squares: a row's causal attention is quadratic in its length)."""
    return {"mean": float(lengths.mean()), "p50": float(np.percentile(lengths, 50)),
            "p95": float(np.percentile(lengths, 95)), "max": int(lengths.max()),
            "sum_of_squares": int((lengths.astype(np.float64) ** 2).sum())}


@dataclass
class SampleSplit:
    """One split of prepared samples, memory-mapped."""

    ids: np.ndarray
    trained: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, indices: np.ndarray, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, targets, document ids) of a row of seq_len holding samples `indices` in order, each cut at
        seq_len + 1 tokens (train/packing.py), then padding (document id -1)."""
        inputs = np.full(seq_len, pad_id, dtype=np.int64)
        targets = np.full(seq_len, IGNORE, dtype=np.int64)
        documents = np.full(seq_len, -1, dtype=np.int64)
        at = 0
        for document, index in enumerate(indices):
            start, end = int(self.offsets[index]), int(self.offsets[index + 1])
            end = min(end, start + seq_len + 1)
            ids = np.asarray(self.ids[start:end], dtype=np.int64)
            n = len(ids) - 1
            inputs[at:at + n] = ids[:-1]
            targets[at:at + n] = np.where(np.asarray(self.trained[start + 1:end], dtype=bool), ids[1:], IGNORE)
            documents[at:at + n] = document
            at += n
        assert at <= seq_len, "a row's samples overflow it (train/packing.plan_rows)"
        return inputs, targets, documents

    def positions(self, seq_len: int) -> np.ndarray:
        """Each sample's positions in a row (train/packing.py)."""
        return sample_positions(np.diff(self.offsets), seq_len)

    def usable(self, seq_len: int, truncation: str = "cut") -> tuple[np.ndarray, int]:
        """(the samples with a trained token within seq_len + 1 tokens, how many are longer): data.truncation
        cut keeps a longer one's first seq_len + 1 tokens, drop leaves it out."""
        starts, lengths = self.offsets[:-1], np.diff(self.offsets)
        keep = [i for i in range(len(self))
                if (truncation == "cut" or lengths[i] <= seq_len + 1)
                and self.trained[starts[i] + 1:starts[i] + min(lengths[i], seq_len + 1)].any()]
        return np.asarray(keep, dtype=np.int64), int((lengths > seq_len + 1).sum())


def load_samples(root: Path, manifest: dict[str, Any], dtype: np.dtype) -> dict[str, SampleSplit]:
    """The prepared splits of `root`, checked against the manifest's counts."""
    splits = {}
    for split in ("train", "val"):
        paths = {kind: root / f"{split}.{kind}" for kind in ("bin", "mask", "idx")}
        missing = [p.name for p in paths.values() if not p.is_file()]
        if missing:
            raise ConfigError(f"data.path={str(root)!r}: {', '.join(missing)} missing; the folder is damaged: "
                              "delete it and prepare the data again")
        ids = np.memmap(paths["bin"], dtype=dtype, mode="r")
        trained = np.memmap(paths["mask"], dtype=np.uint8, mode="r")
        offsets = np.fromfile(paths["idx"], dtype=np.int64)
        if len(ids) != manifest["num_tokens"][split] or len(trained) != len(ids) or \
                len(offsets) != manifest["num_samples"][split] + 1 or int(offsets[-1]) != len(ids):
            raise ConfigError(f"data.path={str(root)!r}: the {split} split's files disagree with {split}'s counts "
                              "in manifest.json; the folder is damaged: delete it and prepare the data again")
        splits[split] = SampleSplit(ids, trained, offsets)
    return splits


class SampleSampler(StepRows):
    """Rows of samples (packed, or one a row: train/packing.py), drawn per step as StepRows draws
    (train/step_rows.py). Packed batches are (inputs, targets, document ids), others (inputs, targets)."""

    def __init__(self, split: SampleSplit, seq_len: int, batch_size: int, seed: int, pad_id: int,
                 rank: int = 0, world_size: int = 1, grad_accum_steps: int = 1, truncation: str = "cut",
                 packing: bool = False) -> None:
        super().__init__(batch_size, seed, rank, world_size, grad_accum_steps)
        self.usable, longer = split.usable(seq_len, truncation)
        if not len(self.usable):
            raise ConfigError(f"training.seq_len={seq_len}: no sample has a token to train on within its first "
                              f"{seq_len + 1} tokens (data.truncation={truncation}); use a longer training.seq_len")
        dropped = len(split) - len(self.usable)
        if longer and truncation == "drop":
            warnings.warn(f"data: {longer} of {len(split)} training samples are longer than training.seq_len + 1 = "
                          f"{seq_len + 1} tokens and are left out (data.truncation=drop); {dropped} left out in all",
                          stacklevel=2)
        elif longer or dropped:
            warnings.warn(f"data: {longer} of {len(split)} training samples are longer than training.seq_len + 1 = "
                          f"{seq_len + 1} tokens and are cut there; {dropped} of them keep no token to train on and "
                          "are left out", stacklevel=2)
        self.split, self.seq_len, self.pad_id, self.packing = split, seq_len, pad_id, packing
        self.rows = plan_rows(self.usable, split.positions(seq_len), seq_len, packing, seed)
        starts = split.offsets[:-1]
        ends = starts + split.positions(seq_len) + 1
        trained = np.zeros(len(split), dtype=np.int64)
        trained[self.usable] = [int(np.count_nonzero(split.trained[starts[i] + 1:ends[i]])) for i in self.usable]
        self.row_trained = self.rows.per_row(trained)
        """Each row's trained targets."""

    def step_trained_tokens(self) -> int:
        """The trained targets of the global batch (every rank, every micro-batch) of the optimizer step the
        next batch belongs to: what the step's loss is the mean over (train/step.py)."""
        step = self.position // self.grad_accum_steps
        return int(self.row_trained[self.step_draw(step, len(self.rows))].sum())

    def next_batch(self) -> tuple[torch.Tensor, ...]:
        return _stack(self.split, self.rows, self.next_rows(len(self.rows)), self.pad_id, self.packing)

    def note(self) -> str:
        """The log's line on the rows: how many, how full."""
        kind = "packed" if self.packing else "one sample a row (data.packing=false)"
        return (f"fine-tuning rows: {len(self.usable)} samples in {len(self.rows)} rows of {self.seq_len} "
                f"positions, {kind}; {100 * self.rows.fill:.1f}% of positions hold tokens, the rest padding")


def sample_eval_batches(split: SampleSplit, seq_len: int, batch_size: int, num_batches: int,
                        pad_id: int, packing: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The validation samples' rows in order (repeated when fewer than asked): the same batches at every
    evaluation."""
    usable, _ = split.usable(seq_len)
    if not len(usable):
        raise ConfigError(f"training.seq_len={seq_len}: no validation sample has a token to train on within "
                          f"its first {seq_len + 1} tokens; use a longer training.seq_len")
    plan = plan_rows(usable, split.positions(seq_len), seq_len, packing)
    rows = np.resize(np.arange(len(plan)), num_batches * batch_size)
    return (_stack(split, plan, rows[i:i + batch_size], pad_id, packing) for i in range(0, len(rows), batch_size))


def _stack(split: SampleSplit, plan: RowPlan, rows: np.ndarray, pad_id: int, packing: bool
           ) -> tuple[torch.Tensor, ...]:
    """The batch of rows `rows` of `plan`: (inputs, targets), and the document ids when packed."""
    import torch

    built = [split.row(plan.row(int(r)), plan.seq_len, pad_id) for r in rows]
    parts = [torch.from_numpy(np.stack([b[k] for b in built])) for k in range(3)]
    return tuple(parts) if packing else (parts[0], parts[1])


def template_folders(tokenizer: str, init_from: str) -> list[str]:
    """The folders a run's chat template is looked for in: the tokenizer's, then the model's."""
    folders = []
    if tokenizer not in ("bytes", "train", ""):
        path = Path(tokenizer).expanduser()
        folders.append(str(path if path.is_dir() else path.parent))
    if init_from:
        folders.append(os.fspath(Path(init_from).expanduser()))
    return folders


def check_packing_layout(layout: Layout) -> None:
    """Packed rows need their document ids in every attention: context parallelism splits a row's positions
    over ranks, and pipeline stages pass on hidden states only, so neither carries them."""
    for field, size in (("parallel.cp", layout.cp), ("parallel.pp", layout.pp)):
        if size > 1:
            raise ConfigError(f"data.packing=true: {field}={size} does not carry packed rows' sample boundaries "
                              "to every attention; set data.packing=false (one sample a padded row, which "
                              f"{field} runs) or {field}=1")


def packed_attention_note(device_type: str) -> str:
    """The log's line on how packed rows' attention keeps to each sample (architecture.document_mask_kernel)."""
    if document_mask_kernel(device_type) == "flex":
        return "packed samples: FlexAttention with a block mask of the rows' samples (blocks no sample spans skipped)"
    return ("packed samples: SDPA with an explicit block-diagonal mask of rows x seq_len x seq_len per window "
            "(each sample attends to itself only)")
