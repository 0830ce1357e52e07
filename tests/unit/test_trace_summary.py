"""perf/trace.py on hand-made Chrome traces: where each microsecond of a step goes, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfit.config import ConfigError
from trainfit.perf.trace import intersect, load_profiles, subtract, summarise, union


def span(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def memory(ts: float, total: int, size: int, device_type: int = 0) -> dict:
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 7, "tid": 1, "ts": ts,
            "args": {"Total Allocated": total, "Bytes": size, "Device Type": device_type}}


def trace(*events: dict, rank: int = 0, world_size: int = 2) -> dict:
    return {"traceEvents": list(events), "distributedInfo": {"rank": rank, "world_size": world_size},
            "host_name": "h"}


STEP = span("ProfilerStep#3", 0, 100, cat="user_annotation")


def test_interval_arithmetic() -> None:
    assert union([(5, 8), (0, 2), (1, 3), (8, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert intersect([(0, 3), (5, 9)], [(2, 6)]) == [(2, 3), (5, 6)]
    assert subtract([(0, 10), (20, 30)], [(2, 4), (6, 22), (29, 40)]) == [(0, 2), (4, 6), (22, 29)]


def test_cpu_step_splits_into_compute_exposed_communication_and_idle() -> None:
    """Training thread: op A [0,40] launching a collective [10,20] (whose allocation [12,13] is
    compute), op B [60,90]; gloo's worker transfers [15,70]; op C [150,160] is after the step."""
    profile = summarise(trace(
        STEP, span("aten::A", 0, 40), span("c10d::allreduce_", 10, 10), span("aten::empty", 12, 1),
        span("aten::B", 60, 30), span("gloo:all_reduce", 15, 55, tid=2, cat="user_annotation"),
        span("aten::C", 150, 10),
        memory(1, 1000, 100), memory(30, 1500, 500), memory(80, 1200, -300), memory(155, 9000, 7800)))
    assert (profile.rank, profile.world_size, profile.device, profile.steps) == (0, 2, "cpu", [3])
    assert profile.wall_us == 100
    assert profile.compute_us == 10 + 1 + 20 + 30  # A's self time, the allocation, B
    assert profile.comm_us == 2 + 57  # the launch's own [10,12], then [13,20] and gloo's transfer to 70
    assert profile.exposed_comm_us == 2 + 7 + 20  # all but gloo's [20,40], which A's compute hides
    assert profile.idle_us == 10  # [90,100]
    assert profile.compute_us + profile.exposed_comm_us + profile.idle_us == profile.wall_us
    assert profile.memory_growth_bytes == 1500 - 900  # above the 900 bytes in use before the step
    ops = {op.name: (op.calls, op.self_us) for op in profile.ops}
    assert ops == {"gloo:all_reduce": (1, 55), "aten::A": (1, 30), "aten::B": (1, 30),
                   "c10d::allreduce_": (1, 9), "aten::empty": (1, 1)}
    assert profile.ops[0].name == "gloo:all_reduce"


def test_fsdp_ranges_around_collectives_are_communication_their_copies_compute() -> None:
    profile = summarise(trace(
        STEP, span("FSDP::all_gather (layers.0)", 0, 50, cat="user_annotation"), span("aten::copy_", 5, 10),
        span("FSDP::all_gather_copy_out (layers.0)", 60, 20, cat="user_annotation")))
    assert profile.compute_us == 10 + 20
    assert profile.comm_us == profile.exposed_comm_us == 40


def test_gpu_trace_is_summarised_on_the_device_timeline() -> None:
    """A GEMM [0,50] and an NCCL all-reduce [30,80] on two streams; the host's ops do not count."""
    profile = summarise(trace(
        STEP, span("aten::mm", 0, 100),
        span("sm90_xmma_gemm", 0, 50, tid=7, cat="kernel"),
        span("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 30, 50, tid=13, cat="kernel"),
        span("Memcpy DtoH", 85, 5, tid=7, cat="gpu_memcpy"),
        memory(1, 10_000, 1000, device_type=1), memory(40, 12_000, 2000, device_type=1), memory(41, 99, 99)))
    assert profile.device == "cuda"
    assert (profile.compute_us, profile.comm_us, profile.exposed_comm_us, profile.idle_us) == (55, 50, 30, 15)
    assert profile.memory_growth_bytes == 12_000 - 9_000
    assert [op.name for op in profile.ops] == ["sm90_xmma_gemm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                                               "Memcpy DtoH"]


def test_folders_of_traces(tmp_path: Path) -> None:
    for rank in (1, 0):
        (tmp_path / f"rank{rank}.pt.trace.json").write_text(json.dumps(trace(STEP, rank=rank)))
    assert [p.rank for p in load_profiles(tmp_path)] == [0, 1]
    (tmp_path / "rank2.pt.trace.json").write_text(json.dumps(trace(STEP, rank=2, world_size=4)))
    with pytest.raises(ConfigError, match="world sizes \\[2, 4\\] mixed"):
        load_profiles(tmp_path)
    with pytest.raises(ConfigError, match="has no \\*.pt.trace.json files"):
        load_profiles(tmp_path / "..")
    (tmp_path / "bad.pt.trace.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a Chrome trace"):
        load_profiles(tmp_path / "bad.pt.trace.json")
