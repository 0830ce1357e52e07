"""Which fine-tuning samples share a row (data.packing). A sample of n tokens takes n - 1 positions of a row
(its inputs, each predicting the next token), at most seq_len: a longer one keeps its first seq_len + 1
tokens, as in a padded row. Packed, the samples are taken in a seeded random order and each row is filled
with whole samples until the next does not fit (no sample is split across rows); the rest of a row is
padding. Unpacked, each sample has a row of its own. The model keeps each sample's positions and attention
to itself (models/document_attention.py), so a sample's per-token loss is the same either way.
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PACKING_STREAM = 0x7061636B
"""The second seed word of the packing order's generator (default_rng([seed, PACKING_STREAM])), apart from
the per-step draws' ([seed, step])."""


@dataclass(frozen=True)
class RowPlan:
    """Row r holds samples[starts[r]:starts[r + 1]], in that order; `positions[i]`: sample i's positions."""

    samples: np.ndarray
    starts: np.ndarray
    positions: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row(self, r: int) -> np.ndarray:
        return self.samples[self.starts[r]:self.starts[r + 1]]

    @property
    def fill(self) -> float:
        """The share of the rows' positions that hold a sample's token (the rest is padding)."""
        return float(self.positions[self.samples].sum()) / (len(self) * self.seq_len)

    def per_row(self, per_sample: np.ndarray) -> np.ndarray:
        """A per-sample count summed over each row's samples."""
        sums = np.concatenate([[0], np.cumsum(per_sample[self.samples])])
        return sums[self.starts[1:]] - sums[self.starts[:-1]]


def sample_positions(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Each sample's positions in a row: its tokens less one, at most seq_len."""
    return np.minimum(lengths, seq_len + 1) - 1


def plan_rows(usable: np.ndarray, positions: np.ndarray, seq_len: int, packing: bool,
              seed: int | None = None) -> RowPlan:
    """The rows of the `usable` samples: one each, or packed (module docstring) in a seeded random order
    (`seed` None: in the order given, as validation packs its samples)."""
    if not packing:
        return RowPlan(usable, np.arange(len(usable) + 1), positions, seq_len)
    order = usable if seed is None else np.random.default_rng([seed, PACKING_STREAM]).permutation(usable)
    starts, filled = [0], 0
    for i, sample in enumerate(order):
        n = int(positions[sample])
        if filled + n > seq_len:
            starts.append(i)
            filled = 0
        filled += n
    starts.append(len(order))
    return RowPlan(np.asarray(order, dtype=np.int64), np.asarray(starts, dtype=np.int64), positions, seq_len)
