"""`trainfit validate`: the predictions checked against measured steps on this machine, in minutes.

In order, each in a process of its own with a time limit, under one budget: `trainfit calibrate
--quick` (one rank: no collectives), whose profile then prices every point's predicted step time;
`trainfit train` (the default run on CUDA; a few steps of the debug model on the CPU); then every
point of the grid (grid.py), each with its analytic and traced peak and step time beside its
measured ones (worker.py). The driver imports no torch: a CUDA context here would hold device
memory through every point. Each entry is printed as it finishes and the JSON file rewritten
atomically, so a crash loses nothing that finished.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from trainfit.config import ConfigError, write_atomic
from trainfit.validate import machine
from trainfit.validate.grid import Grid, Point, build_grid, select, with_cpu_slow_included
from trainfit.validate.limited import run_with_limit
from trainfit.validate.table import COLUMNS, cells, errors, line, note, summary_table, unit_of

STEPS = ("calibrate", "train")
"""The runner's own entries, before the grid's points."""
ERROR_TAIL = 3000
"""Characters of a failed entry's output kept in the JSON."""
TIMED_STEPS = {"cuda": 3, "cpu": 3}


@dataclass(frozen=True)
class Timing:
    expected_s: float
    """Seconds the entry is expected to take, process start included: on CUDA a plan for an H100
    made before any GPU run (to be replaced by the seconds the first run records); on the CPU
    measured on a 2-core machine. An entry is skipped when less than this is left of the budget."""
    limit_s: float


TIMINGS = {
    "cuda": {"calibrate": Timing(45, 150), "train": Timing(60, 180), "point": Timing(25, 150),
             "dense-bf16-compile": Timing(90, 300)},
    "cpu": {"calibrate": Timing(12, 90), "train": Timing(8, 90), "point": Timing(5, 90),
            "dense-bf16-compile": Timing(70, 240)},
}
CPU_TRAIN = ("--model.preset=debug", "--training.steps=6", "--training.eval_interval=3", "--training.seq_len=32",
             "--training.micro_batch_size=4", "--training.warmup_steps=2", "--logging.interval=1")
"""`trainfit train` in CPU mode: the default run takes minutes on a CPU."""


def child_env(device: str) -> dict[str, str]:
    """The children's environment: trainfit importable as this process imported it, output unbuffered,
    and in CPU mode no GPU visible (calibrate and train pick cuda whenever they see one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(machine.PACKAGE.parent), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_limited(cmd: list[str], env: dict[str, str], limit_s: float, folder: Path) -> tuple[int | None, float, str]:
    """(exit code or None at the limit, seconds, stdout) of `cmd` in its own process group (its
    children die with it at the limit); stderr and stdout kept in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "stdout.txt"
    rc, seconds = run_with_limit(cmd, env, limit_s, out, folder / "output.log")
    return rc, seconds, out.read_text(errors="replace")


def _failure(rc: int | None, limit_s: float, folder: Path) -> dict[str, Any]:
    text = ((folder / "output.log").read_text(errors="replace") + (folder / "stdout.txt").read_text(errors="replace"))
    head = f"timed out after {limit_s:.3g} s" if rc is None else f"exit code {rc}"
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    found = [s for s in lines if "Error" in s or "error:" in s]
    return {"status": "failed", "error": f"{head}\n{text[-ERROR_TAIL:]}",
            "error_line": f"{head}: {(found or lines or [''])[-1]}"[:300]}


def run_calibrate(env: dict[str, str], work: Path, limit_s: float) -> dict[str, Any]:
    profile = work / "calibrate" / "profile.toml"
    cmd = [sys.executable, "-m", "trainfit", "calibrate", "--quick", "--max-ranks", "1", "--out", str(profile),
           "--force", "--json"]
    rc, seconds, stdout = run_limited(cmd, env, limit_s, work / "calibrate")
    entry: dict[str, Any] = {"kind": "command", "command": " ".join(cmd[1:]), "seconds": round(seconds, 1)}
    if rc != 0:
        return {**entry, **_failure(rc, limit_s, work / "calibrate")}
    found = json.loads(stdout)
    rates = {dtype: rate / 1e12 for dtype, rate in found["matmul_flops_per_s"].items()}
    figures = {"matmul_tflops": rates, "memory_gb_per_s": found["memory_bytes_per_s"] / 1e9,
               "device": found["machine"]["device"], "name": found["machine"]["name"]}
    summary = ", ".join(f"{k} {v:,.3g}" for k, v in rates.items()) + " TFLOP/s"
    return {**entry, "status": "ok", "figures": figures, "summary": summary, "profile": found,
            "profile_path": str(profile)}


def run_train(env: dict[str, str], work: Path, device: str, limit_s: float) -> dict[str, Any]:
    folder = work / "train"
    cmd = [sys.executable, "-m", "trainfit", "train", f"--training.device={device}",
           *(CPU_TRAIN if device == "cpu" else ()), f"--checkpoint.dir={folder / 'ckpt'}",
           f"--logging.dir={folder / 'logs'}", "--logging.progress=false", "--checkpoint.resume=never"]
    rc, seconds, _ = run_limited(cmd, env, limit_s, folder)
    entry: dict[str, Any] = {"kind": "command", "command": " ".join(cmd[1:]), "seconds": round(seconds, 1)}
    if rc != 0:
        return {**entry, **_failure(rc, limit_s, folder)}
    records = [json.loads(s) for s in (folder / "logs" / "metrics.jsonl").read_text().splitlines() if s.strip()]
    steps = [r for r in records if "loss" in r]
    rates = [r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    peaks = [r for r in steps if r.get("peak_memory_bytes")]
    figures = {"steps": steps[-1]["step"] if steps else 0, "last_loss": steps[-1]["loss"] if steps else None,
               "median_tokens_per_s": statistics.median(rates) if rates else None,
               "tensor_peak_bytes": peaks[-1]["peak_memory_bytes"] if peaks else None,
               "reserved_peak_bytes": peaks[-1].get("memory_reserved_peak_bytes") if peaks else None}
    return {**entry, "status": "ok", "figures": figures,
            "summary": f"{figures['steps']} steps, loss {figures['last_loss']:.3f}, "
                       f"{figures['median_tokens_per_s'] or 0:,.0f} tokens/s"}


def run_point(point: Point, env: dict[str, str], work: Path, device: str, profile: str | None,
              limit_s: float) -> dict[str, Any]:
    folder = work / point.name
    overrides = [*point.overrides, *([f"--hardware.profile={profile}"] if profile else []),
                 f"--checkpoint.dir={folder / 'ckpt'}", f"--logging.dir={folder / 'logs'}"]
    result = folder / "result.json"
    cmd = [sys.executable, "-m", "trainfit.validate.worker", str(result), "--timed-steps", str(TIMED_STEPS[device]),
           "--", *overrides]
    folder.mkdir(parents=True, exist_ok=True)
    rc, seconds, _ = run_limited(cmd, env, limit_s, folder)
    found = json.loads(result.read_text()) if result.is_file() else {"predicted": {}, "measured": {}}
    entry: dict[str, Any] = {"kind": "grid", "model": point.model, "technique": point.technique,
                             "overrides": list(point.overrides), "seconds": round(seconds, 1),
                             "time_basis": "calibrate --quick profile" if profile else "catalog",
                             "status": "ok", **found, **({"caveat": point.caveat} if point.caveat else {})}
    if rc != 0:
        entry.update(_failure(rc, limit_s, folder))
    entry["errors"] = errors(entry)
    return entry


def run_entry(name: str, point: Point | None, env: dict[str, str], work: Path, device: str, profile: str | None,
              limit_s: float) -> dict[str, Any]:
    """One entry: the runner's own step `name`, or the grid's `point`."""
    if name == "calibrate":
        return run_calibrate(env, work, limit_s)
    if name == "train":
        return run_train(env, work, device, limit_s)
    assert point is not None
    return run_point(point, env, work, device, profile, limit_s)


def skipped(point: Point | None, reason: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": "grid" if point else "command", "status": "skipped", "reason": reason,
                             "seconds": 0.0}
    if point is not None:
        entry.update(model=point.model, technique=point.technique, overrides=list(point.overrides),
                     predicted={"analytic_peak_bytes": point.analytic_peak or None}, measured={})
    return entry


def resolve_device(device: str, env: dict[str, str]) -> tuple[dict[str, Any], Grid]:
    """The machine's description and the grid for the device asked (auto: cuda where torch sees a GPU)."""
    found, info = machine.probe(device, env)
    if info is None:
        why = found.get("device_error") or found.get("probe_error")
        if device == "cuda" and not why:
            raise ConfigError("--device cuda: torch sees no GPU here; use --device cpu (or auto)")
        raise ConfigError(f"--device {device}: torch could not describe this machine's device: {why}")
    return found, build_grid(info)


def validate(*, device: str, out: Path, budget_s: float, only: list[str], console: Console) -> int:
    """Run the steps and points (all, or `only`), print them, write `out`; 1 if any failed."""
    from trainfit.tables import print_table
    start = time.monotonic()
    if only:  # a misspelt name fails at once, before the device is probed
        select(None, only, list(STEPS))
    env = child_env(device)
    environment, grid = resolve_device(device, env)
    kind = grid.device.kind
    if kind == "cpu":
        env = child_env("cpu")
    names = select(grid, only, list(STEPS)) if only else [*STEPS, *(p.name for p in grid.points)]
    if kind == "cpu" and only:
        grid = with_cpu_slow_included(grid, names)
    points = {p.name: p for p in grid.points}
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": kind,
        "device_name": grid.device.name, "budget_s": budget_s, "command": " ".join(sys.argv),
        "machine": {**environment, "nvidia_smi": machine.nvidia_smi()}, "trainfit": machine.trainfit_source(),
        "grid": {"device": dataclasses.asdict(grid.device), "hardware": list(grid.hardware),
                 "models": {k: list(v) for k, v in grid.models.items()}, "notes": grid.notes},
        "points": {}, "total_seconds": 0.0, "finished": False}
    write_atomic(out, json.dumps(report, indent=1))
    smi = report["machine"]["nvidia_smi"] or {}
    entries = f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}"
    console.print(f"trainfit validate on {grid.device.name} ({kind}): torch {environment.get('torch')}, CUDA "
                  f"{environment.get('cuda')}, driver {smi.get('driver_version')}; {entries}, budget "
                  f"{budget_s:.0f} s" + "".join(f"\n{note}" for note in grid.notes), highlight=False)
    console.print(f"peaks in {unit_of(kind)[0]}: analytic and traced predicted, allocated and reserved measured; "
                  "err: (predicted - measured) / measured", highlight=False)
    console.print(line(list(COLUMNS)), highlight=False)
    work = Path(tempfile.mkdtemp(prefix="trainfit-validate-"))
    profile: str | None = None
    try:
        for i, name in enumerate(names, 1):
            point = points.get(name)
            timing = TIMINGS[kind].get(name) or TIMINGS[kind]["point"]
            left = budget_s - (time.monotonic() - start)
            if point is not None and point.skip:
                entry = skipped(point, point.skip)
            elif left < timing.expected_s:
                entry = skipped(point, f"budget: {left:.0f} s left, this needs about {timing.expected_s:.0f} s")
            else:
                limit = min(timing.limit_s, left)
                with console.status(f"[{i}/{len(names)}] {name} (at most {limit:.0f} s)"):
                    entry = run_entry(name, point, env, work, kind, profile, limit)
                if name == "calibrate" and entry["status"] == "ok":
                    profile = entry.pop("profile_path")  # a scratch file: the JSON holds the profile
            report["points"][name] = entry
            report["total_seconds"] = round(time.monotonic() - start, 1)
            write_atomic(out, json.dumps(report, indent=1))
            console.print(line(cells(name, entry, kind)), highlight=False, soft_wrap=True)
            if note(entry):
                console.print(f"    {note(entry)}", highlight=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["finished"] = True
    write_atomic(out, json.dumps(report, indent=1))
    print_table(summary_table(report), console)
    for name, entry in report["points"].items():
        if entry["status"] != "ok":
            console.print(f"{name}: {entry['status']}: {note(entry)}", highlight=False)
    failed = [n for n, e in report["points"].items() if e["status"] == "failed"]
    console.print(f"{report['total_seconds']:.1f} s; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''};"
                  f" wrote {out}", highlight=False)
    return 1 if failed else 0
