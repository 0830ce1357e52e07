"""Where each rank's profiled steps went, read from torch.profiler's Chrome traces. Torch-free.

`trainfit train --profile=STEPS` writes one trace per rank (train/profile.py); `summarise(trace)`
splits the time of its `ProfilerStep#<n>` ranges (the steps) into

- compute: something other than communication runs. On a GPU (the trace has `kernel` events):
  kernels other than NCCL's, memcpys and memsets, on any stream. On CPU: the innermost event
  running on some thread of the process is an operator (aten, autograd, optimizer), not a
  collective: an event's self time (its time minus its children's) is classified by its own name.
- communication: a collective is in flight. On a GPU: NCCL kernels (`ncclDevKernel_*`,
  `ncclKernel_*`). On CPU: events named as the process group names them, `gloo:<collective>` on
  gloo's worker threads (the transfer, including the wait for the slowest peer), and the calls that
  launch or wait for them on the training thread (`c10d::allreduce_`, `_c10d_functional::wait_tensor`,
  `record_param_comms`, `nccl:<collective>`, and FSDP2's `FSDP::all_gather`,
  `FSDP::post_backward_reduce`, `FSDP::post_backward_rs_wait`, whose self time is launching and waiting;
  the copies inside them are compute). A wait outside any such event (DDP's, in C++) shows as idle.
- exposed communication: communication while no compute runs (what a faster network would save).
- idle: neither (on CPU: Python between operators and waits outside a collective; on a GPU: the
  devices starved by the host, or waiting on each other outside NCCL's kernels).

So compute + exposed communication + idle = the steps' wall time. Operators are ranked by self
time (an event's time minus its children's; on a GPU, kernels). Memory: the most the profiled steps
allocated above what was in use when they began, from the profiler's `[memory]` events.

The event names were read from torch 2.13's traces of trainfit's gloo runs (c10d's ProcessGroupGloo
records `gloo:all_reduce` etc. on its worker threads; c10d's ops are `c10d::<op>_` in the dispatcher)
and from NCCL's kernel names.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainfit.config import ConfigError

Interval = tuple[float, float]
"""(start, end) in the trace's microseconds."""

HOST_COMM = re.compile(r"(gloo:|nccl:|c10d::|_c10d_functional::|c10d_functional::|record_param_comms)"
                       r"|FSDP::(all_gather|post_backward_reduce|post_backward_rs_wait)( \(|$)")
"""Host events that are communication: process groups' own, and FSDP2's ranges around its collectives
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), whose self time is the launch and the wait."""
DEVICE_COMPUTE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
STEP_PREFIX = "ProfilerStep#"
TRACE_GLOBS = ("*.pt.trace.json", "*.pt.trace.json.gz")


@dataclass
class OpTime:
    name: str
    calls: int
    self_us: float


@dataclass
class RankProfile:
    rank: int
    world_size: int
    device: str
    """"cuda" when the trace has GPU kernels (the device timeline is summarised), else "cpu"."""
    steps: list[int]
    wall_us: float
    compute_us: float
    comm_us: float
    exposed_comm_us: float
    idle_us: float
    memory_growth_bytes: int | None
    """The most allocated above the in-use bytes when the first profiled step began (None: not recorded)."""
    ops: list[OpTime]
    """Every operator (on a GPU, kernel) by self time inside the steps, the largest first."""
    host: str = ""
    windows: list[Interval] = field(default_factory=list)
    compute: list[Interval] = field(default_factory=list)
    comm: list[Interval] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, without the intervals."""
        out = dataclasses.asdict(self)
        for name in ("windows", "compute", "comm"):
            del out[name]
        return out


# ---------------------------------------------------------------- intervals (sorted, disjoint lists)


def union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


# ---------------------------------------------------------------- one trace


def is_host_comm(name: str) -> bool:
    return HOST_COMM.match(name) is not None


def is_device_comm(name: str) -> bool:
    return name.startswith("nccl")


def _self_intervals(events: list[dict]) -> list[tuple[dict, list[Interval]]]:
    """(event, its time minus its children's) for the nested events of one thread."""
    out = []
    stack: list[tuple[dict, float, list[Interval]]] = []  # event, end, children's intervals

    def pop() -> None:
        event, end, children = stack.pop()
        out.append((event, subtract([(event["ts"], end)], union(children))))

    for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start = event["ts"]
        while stack and stack[-1][1] <= start:
            pop()
        end = start + event["dur"]
        if stack:
            end = min(end, stack[-1][1])  # rounding: a child never outlives its parent
            stack[-1][2].append((start, end))
        stack.append((event, end, []))
    while stack:
        pop()
    return out


def _inside(ts: float, windows: list[Interval]) -> bool:
    return any(start <= ts < end for start, end in windows)


def _memory_growth(events: list[dict], device_type: int, windows: list[Interval]) -> int | None:
    """Peak `Total Allocated` inside the windows minus the in-use bytes before the first event in them."""
    inside = [e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type
              and _inside(e["ts"], windows)]
    if not inside:
        return None
    first = min(inside, key=lambda e: e["ts"])["args"]
    base = first["Total Allocated"] - first["Bytes"]
    return max(e["args"]["Total Allocated"] for e in inside) - base


def summarise(trace: dict[str, Any], *, rank: int | None = None) -> RankProfile:
    """One rank's profiled steps (see the module docstring). `rank`: when the trace does not name it."""
    events = trace["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    step_events = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith(STEP_PREFIX)]
    if step_events:
        windows = union([(e["ts"], e["ts"] + e["dur"]) for e in step_events])
        steps = sorted(int(e["name"].removeprefix(STEP_PREFIX)) for e in step_events)
    else:  # a trace taken elsewhere: its whole span
        windows = union([(min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans))]) if spans else []
        steps = []
    self_time: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [calls, self us]
    compute: list[Interval] = []
    comm: list[Interval] = []
    device = "cuda" if any(e.get("cat") == "kernel" for e in spans) else "cpu"
    if device == "cuda":
        for e in spans:
            if e.get("cat") in DEVICE_COMPUTE_CATEGORIES:
                interval = [(e["ts"], e["ts"] + e["dur"])]
                (comm if is_device_comm(e["name"]) else compute).extend(interval)
                _count(self_time, e, interval, windows)
    else:
        threads: dict[tuple[Any, Any], list[dict]] = defaultdict(list)
        for e in spans:
            if e.get("cat") in HOST_CATEGORIES and not e["name"].startswith(STEP_PREFIX):
                threads[e.get("pid"), e.get("tid")].append(e)
        for thread_events in threads.values():
            for event, intervals in _self_intervals(thread_events):
                (comm if is_host_comm(event["name"]) else compute).extend(intervals)
                _count(self_time, event, intervals, windows)
    compute, comm = intersect(union(compute), windows), intersect(union(comm), windows)
    busy = union(compute + comm)
    ops = sorted((OpTime(name, int(calls), us) for name, (calls, us) in self_time.items() if calls),
                 key=lambda op: -op.self_us)
    info = trace.get("distributedInfo") or {}
    return RankProfile(
        rank=info.get("rank", rank or 0), world_size=info.get("world_size", 1), device=device, steps=steps,
        wall_us=total(windows), compute_us=total(compute), comm_us=total(comm),
        exposed_comm_us=total(subtract(comm, compute)), idle_us=total(subtract(windows, busy)),
        memory_growth_bytes=_memory_growth(events, 1 if device == "cuda" else 0, windows), ops=ops,
        host=trace.get("host_name", ""), windows=windows, compute=compute, comm=comm)


def _count(self_time: dict[str, list[float]], event: dict, intervals: list[Interval], windows: list[Interval]) -> None:
    """A call of `event` when it starts inside the steps; its self time inside them."""
    if _inside(event["ts"], windows):
        self_time[event["name"]][0] += 1
    self_time[event["name"]][1] += total(intersect(intervals, windows))


# ---------------------------------------------------------------- files


def trace_files(path: str | Path) -> list[Path]:
    """The traces of `path`: a file, or a folder's *.pt.trace.json(.gz) (`trainfit train --profile` writes
    <logging.dir>/profile/rank<r>.pt.trace.json)."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(f for pattern in TRACE_GLOBS for f in path.glob(pattern)) if path.is_dir() else []
    if not files:
        what = "has no *.pt.trace.json files" if path.is_dir() else "does not exist"
        raise ConfigError(f"--profile {str(path)!r}: {what}; give the folder `trainfit train --profile=STEPS` "
                          "wrote (<logging.dir>/profile) or one trace file")
    return files


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        try:
            trace = json.load(f)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--profile {str(path)!r}: not a JSON trace ({err})") from err
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ConfigError(f"--profile {str(path)!r}: not a Chrome trace (no traceEvents)")
    return trace


def load_profiles(path: str | Path) -> list[RankProfile]:
    """Every rank's summary from `path` (see trace_files), by rank; traces of different world sizes
    (two runs' files in one folder) are refused."""
    profiles = []
    for file in trace_files(path):
        match = re.match(r"rank(\d+)", file.name)
        profiles.append(summarise(read_trace(file), rank=int(match.group(1)) if match else None))
    sizes = {p.world_size for p in profiles}
    if len(sizes) > 1:
        raise ConfigError(f"--profile {str(path)!r}: traces of world sizes {sorted(sizes)} mixed (two runs?); "
                          "keep one run's rank*.pt.trace.json files")
    return sorted(profiles, key=lambda p: p.rank)
