"""Estimator tests run tiny tensors: one intra-op thread is fastest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from accuracy_grid import single_thread


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread per test (accuracy_grid.single_thread says why)."""
    with single_thread():
        yield
