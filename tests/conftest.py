"""Shared fixtures: isolated cache and run folders, restored global torch state."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared datasets go to a per-session cache, never to the user's home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(autouse=True)
def _restore_torch_state() -> None:
    import torch

    dtype, rng, threads = torch.get_default_dtype(), torch.get_rng_state(), torch.get_num_threads()
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(rng)
    torch.set_num_threads(threads)
