"""Estimator tests run tiny tensors: one intra-op thread is fastest."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is fastest, and on shared cores idle OpenMP workers spin
    (2 threads made these tests 30x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
