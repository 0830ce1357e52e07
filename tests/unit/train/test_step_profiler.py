"""train/profile.StepProfiler without training: which steps it wraps, what it tells the log, and on
CUDA (stood in for: this machine has no GPU) the memory snapshot beside the trace."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainfit.train import profile as profile_module
from trainfit.train.profile import StepProfiler


class FakeProfiler:
    """Stands in for torch.profiler.profile: records what it was asked."""

    def __init__(self, calls: list, **kwargs: object) -> None:
        self.calls, self.kwargs = calls, kwargs

    def __enter__(self) -> FakeProfiler:
        self.calls.append(("profile", self.kwargs["activities"]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.calls.append(("stop",))

    def export_chrome_trace(self, path: str) -> None:
        self.calls.append(("export", Path(path).name))


def test_on_cuda_the_window_gets_a_trace_and_a_memory_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []

    @contextlib.contextmanager
    def history(path: Path | None) -> Iterator[None]:
        calls.append(("history", path.name if path else None))
        yield
        calls.append(("snapshot",))

    monkeypatch.setattr(profile_module, "profile", lambda **kw: FakeProfiler(calls, **kw))
    monkeypatch.setattr(profile_module, "cuda_history", history)
    (tmp_path / "rank1.pt.trace.json").write_text("{}")  # another rank's file of this world: kept
    profiler = StepProfiler((2, 3), tmp_path, rank=0, world_size=2, device=torch.device("cuda"))
    for step in (1, 2, 3, 4):
        with profiler.step(step):
            calls.append(("step", step))
    cuda = torch.profiler.ProfilerActivity.CUDA
    assert calls == [("step", 1), ("history", "rank0.memory_snapshot.pickle"),
                     ("profile", [torch.profiler.ProfilerActivity.CPU, cuda]), ("step", 2), ("step", 3),
                     ("stop",), ("snapshot",), ("export", "rank0.pt.trace.json"), ("step", 4)]
    assert [p.name for p in profiler.written] == ["rank0.pt.trace.json", "rank0.memory_snapshot.pickle"]
    assert (tmp_path / "rank1.pt.trace.json").exists()
    profiler.close()  # the loop's `finally`: nothing more
    assert calls[-1] == ("step", 4)


def test_the_cuda_memory_history_keeps_python_stacks_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The snapshot's history (memory/measured/attribution.cuda_history, which `trainfit measure` uses too) is
    recorded with Python stacks, not torch's default C++ ones (slow to dump), in arguments torch's
    own signature accepts; recording stops once the snapshot is dumped."""
    calls: list = []
    real = torch.cuda.memory._record_memory_history

    def record(*args: object, **kwargs: object) -> None:
        bound = inspect.signature(real).bind(*args, **kwargs)  # a TypeError for an argument torch does not take
        calls.append(("record", dict(bound.arguments)))

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    monkeypatch.setattr(profile_module, "profile", lambda **kw: FakeProfiler([], **kw))
    profiler = StepProfiler((1, 1), tmp_path, rank=0, world_size=1, device=torch.device("cuda"))
    with profiler.step(1):
        pass
    assert calls == [("record", {"max_entries": 100_000, "stacks": "python"}),
                     ("dump", "rank0.memory_snapshot.pickle"), ("record", {"enabled": None})]


def test_notes_name_steps_that_will_not_be_plain() -> None:
    profiler = StepProfiler((2, 4), "unused", rank=0, world_size=1, device=torch.device("cpu"))
    assert profiler.notes(0, {1, 2}) == [
        "profiling step(s) 2, which the memory meter watches or measures (slower; on CPU their collectives run one at "
        "a time): profile later steps for a plain step's time"]
    assert profiler.notes(0, {1, 5}) == []
    assert profiler.notes(4, {5, 6}) == ["logging.profile_steps=2-4: the run starts at step 5, after those steps; "
                                         "nothing is profiled"]
    assert StepProfiler(None, "unused", rank=0, world_size=1, device=torch.device("cpu")).notes(0, {1}) == []
