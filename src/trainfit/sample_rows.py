"""What a fine-tuning run's rows hold, as the estimators and the time model price them: whether several
samples share a row (data.packing, train/packing.py) and how long the samples are, from the length
statistics `trainfit prepare-data` records (train/samples.length_statistics). Torch-free.

A causal row of T positions attends T^2 / 2 query-key pairs. A packed row of samples of lengths L_i
attends only within each sample: sum L_i^2 / 2 pairs, which is a causal row of the *effective length*
E = sum L_i^2 / sum L_i per token (the length of the sample an average token sits in; a sample cut at
the row keeps T of its positions, so E <= T). What a kernel computes differs from that useful work
(models/block_cost.py): SDPA under an explicit mask (the CPU form) computes every query-key block of
the row; FlexAttention's block mask (the CUDA form) skips the blocks outside every sample, computing
whole the FLEX_BLOCK-square blocks a sample's diagonal crosses: about E + FLEX_BLOCK.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FLEX_BLOCK = 128
"""FlexAttention's default block size (torch.nn.attention.flex_attention's _DEFAULT_SPARSE_BLOCK_SIZE):
the granularity at which its block mask skips query-key pairs."""


@dataclass(frozen=True)
class SampleRows:
    """Fine-tuning samples' rows (a text stream has none: Layout.rows is None)."""

    packed: bool
    """data.packing: several whole samples a row, each attending to itself only."""
    effective_length: float = 0.0
    """sum L^2 / sum L of the training samples' lengths (module docstring); 0: not known."""
    mean_length: float = 0.0
    """The training samples' mean length in tokens; 0: not known."""
    trained_fraction: float = 1.0
    """Of the training samples' tokens, those the loss trains on (data.loss_on)."""

    @property
    def measured(self) -> bool:
        """Whether the lengths come from the data (a prepared manifest), rather than unknown."""
        return self.effective_length > 0

    def attended_length(self, seq_len: int) -> int:
        """The causal sequence length whose attention is a row's useful attention: the effective length of
        packed samples (capped at the row), else the row's (a padded row's one sample, or unknown lengths)."""
        if not (self.packed and self.measured):
            return seq_len
        return max(1, min(seq_len, round(self.effective_length)))

    def kernel_length(self, seq_len: int, kernel: str) -> int | None:
        """The causal sequence length whose attention is what the document-mask kernel computes for a packed
        row (models/architecture.document_mask_kernel): FlexAttention's whole blocks around each sample
        ("flex"); None for SDPA's explicit mask ("sdpa"), which computes the whole row, not causal."""
        if kernel == "sdpa":
            return None
        return min(seq_len, self.attended_length(seq_len) + FLEX_BLOCK) if self.measured else seq_len

    def scored_share(self, seq_len: int) -> float:
        """Of a row's positions, the share whose target trains (what the chunked loss projects, train/loss.py):
        the samples' trained fraction, of a padded row only its sample's share of the row; packed rows are
        taken full (a bound: greedy packing leaves the ends of some rows empty). 1 when not known."""
        if not self.measured:
            return 1.0
        return self.trained_fraction * (1.0 if self.packed else min(1.0, self.mean_length / seq_len))

    def note(self, seq_len: int) -> str:
        """The estimate's line on how it priced the rows."""
        if not self.packed:
            return "fine-tuning samples one a row (data.packing=false): each row computes as a full one"
        if not self.measured:
            return ("fine-tuning samples packed, their lengths not known yet: attention priced as full rows; "
                    "prepare the data (trainfit prepare-data) to price it from the samples' lengths")
        return (f"fine-tuning samples packed: attention priced at the samples' effective length "
                f"{self.attended_length(seq_len)} of {seq_len} positions (mean sample {self.mean_length:.0f} tokens)")


SAMPLES_LAYOUT = "samples"
"""A prepared folder's manifest "layout" for fine-tuning samples (train/samples.py writes it)."""
MANIFEST = "manifest.json"


def prepared_rows(path: str, packed: bool) -> SampleRows | None:
    """The rows of the fine-tuning samples prepared in folder `path` (`trainfit prepare-data`), from its
    manifest; None when `path` holds none (text, records not prepared, nothing). Read once per version of the
    manifest: the planner asks per candidate layout."""
    manifest = Path(path).expanduser() / MANIFEST
    try:
        stamp = manifest.stat().st_mtime_ns
    except OSError:
        return None
    return _manifest_rows(str(manifest), stamp, packed)


@functools.lru_cache(maxsize=64)
def _manifest_rows(manifest_path: str, stamp: int, packed: bool) -> SampleRows | None:
    del stamp  # the key's part that makes an edited manifest read again
    try:
        manifest = json.loads(Path(manifest_path).read_text())
    except (OSError, ValueError):
        return None  # a damaged folder: the run names it
    if not isinstance(manifest, dict) or manifest.get("layout") != SAMPLES_LAYOUT:
        return None
    return rows_from_manifest(manifest, packed)


def rows_from_manifest(manifest: dict[str, Any], packed: bool) -> SampleRows:
    """The rows of prepared samples, from their manifest's training split (train/samples.write_samples)."""
    stats = manifest.get("lengths", {}).get("train")
    tokens = manifest.get("num_tokens", {}).get("train", 0)
    trained = manifest.get("trained_tokens", {}).get("train", tokens)
    if not stats or not tokens:
        return SampleRows(packed, trained_fraction=trained / tokens if tokens else 1.0)
    return SampleRows(packed, effective_length=stats["sum_of_squares"] / tokens, mean_length=stats["mean"],
                      trained_fraction=trained / tokens)


def scored_rows(trained: int, total: int, chunk_tokens: int) -> int:
    """Rows the masked chunked loss projects of `total` with `trained` targets that train: whole chunks of
    chunk_tokens covering them, at least one row, at most all (train/loss.py; memory/closed_form/logits.py prices
    it)."""
    return min(total, max(1, -(-trained // chunk_tokens) * chunk_tokens))
