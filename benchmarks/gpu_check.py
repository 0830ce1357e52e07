"""One pass over trainfit's CUDA paths on a GPU machine, for a session that has a GPU for minutes:
each check (benchmarks/gpu_checks.py) in a process of its own (a CUDA error or an OOM ends that check
only, and the allocator's statistics start fresh), with its own time limit, under one budget; a table
as it goes and DIR/gpu_check.json with the machine (device, torch, CUDA, driver), the trainfit commit
and each check's status, seconds, figures and error tail.

    PYTHONPATH=src python benchmarks/gpu_check.py --out DIR [--only sdpa,mfu] [--budget-s 480]
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --out DIR   # the same code on the CPU

On the CPU the CUDA-only checks are skipped ("skipped: needs CUDA") and the rest run on the debug
model, which is how this script is tested before a GPU minute is spent on it. This driver imports no
torch: a CUDA context here would hold device memory through every check.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's trainfit, whatever else is installed
from trainfit.validate.limited import run_with_limit  # noqa: E402
from trainfit.validate.machine import nvidia_smi, probe, trainfit_source  # noqa: E402

WORKER = Path(__file__).resolve().parent / "gpu_checks.py"
BUDGET_S = 510
"""The whole run's default time limit: eight and a half of a GPU session's minutes, inside one command of ten."""
ERROR_TAIL = 3000
"""Characters of a failed check's output kept in the JSON (its whole output is in DIR/logs)."""


@dataclass(frozen=True)
class Spec:
    cuda_s: float
    """Seconds on one H200, process start included, as the first GPU run recorded them (2026-12-04,
    benchmarks/results/): rounded up; for the three checks that failed there and the two added since (imports,
    gpt_oss), a plan."""
    cpu_s: float
    """Seconds on the 2-core development machine (measured)."""
    limit_s: float
    """The check's time limit on either device."""
    cuda_only: bool = False


CHECKS = {
    "imports": Spec(cuda_s=15, cpu_s=8, limit_s=60),
    "sdpa": Spec(cuda_s=19, cpu_s=10, limit_s=90),
    "host_time": Spec(cuda_s=19, cpu_s=8, limit_s=60),
    "collective_latency": Spec(cuda_s=15, cpu_s=10, limit_s=60),
    "mfu": Spec(cuda_s=21, cpu_s=15, limit_s=120),
    "memory": Spec(cuda_s=17, cpu_s=10, limit_s=120),
    "fsdp_peak": Spec(cuda_s=25, cpu_s=12, limit_s=120),
    "allocator_pressure": Spec(cuda_s=17, cpu_s=0, limit_s=120, cuda_only=True),
    "offload": Spec(cuda_s=17, cpu_s=10, limit_s=90),
    "resume_rng": Spec(cuda_s=20, cpu_s=10, limit_s=90),
    "profile_dump": Spec(cuda_s=22, cpu_s=15, limit_s=120),
    "measure_snapshot": Spec(cuda_s=16, cpu_s=0, limit_s=120, cuda_only=True),
    "zero1_nccl": Spec(cuda_s=49, cpu_s=35, limit_s=150),
    "calibrate": Spec(cuda_s=27, cpu_s=15, limit_s=150),
    "fp8": Spec(cuda_s=57, cpu_s=25, limit_s=240),
    "softcap": Spec(cuda_s=45, cpu_s=15, limit_s=180),
    "gpt_oss": Spec(cuda_s=30, cpu_s=20, limit_s=120),
    "compile": Spec(cuda_s=33, cpu_s=70, limit_s=240),
}
"""In the order they run: the quick ones first, those that compile last, so a short budget still covers
the most paths. fp8 starts with its eager runs and skips its compiled ones that would not finish in
the time it has (gpu_checks.check_fp8). The planned cuda_s, with the machine's probe, fit BUDGET_S, so that
the last check still starts (tests/test_gpu_check.py holds them to it)."""


def probe_machine(env: dict[str, str]) -> dict[str, Any]:
    """torch's view of this machine, from a process of its own (trainfit.validate.machine)."""
    return probe("auto", env)[0]


def child_env(device: str, work: Path) -> dict[str, str]:
    """The checks' environment: trainfit importable from this checkout, the data cache under the
    work folder, and on `--device cpu` no GPU visible (calibrate picks cuda whenever it sees one)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["XDG_CACHE_HOME"] = str(work / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_check(name: str, device: str, out: Path, env: dict[str, str], limit_s: float) -> dict[str, Any]:
    """The check in its own process group (torchrun's and calibrate's children die with it at the limit)."""
    work, result, log = out / "work" / name, out / "figures" / f"{name}.json", out / "logs" / f"{name}.log"
    for folder in (work, result.parent, log.parent):
        folder.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(WORKER), name, "--device", device, "--work", str(work), "--result", str(result),
           "--time-s", f"{limit_s:.0f}"]
    rc, seconds = run_with_limit(cmd, env, limit_s, log, cwd=ROOT)
    found = json.loads(result.read_text()) if result.is_file() else {}
    entry: dict[str, Any] = {"status": "ok" if rc == 0 else "failed", "seconds": round(seconds, 1),
                             "limit_s": round(limit_s), "figures": found.get("figures", {}),
                             "summary": found.get("summary", "")}
    if rc != 0:
        tail = log.read_text(errors="replace")[-ERROR_TAIL:]
        entry["error"] = (f"timed out after {limit_s:.0f} s\n" if rc is None else f"exit code {rc}\n") + tail
    return entry


def last_error_line(entry: dict[str, Any]) -> str:
    lines = [line for line in entry.get("error", "").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "assert" in line]
    return (errors or lines or [""])[-1].strip()


def print_row(name: str, status: str, seconds: float | None, figures: str) -> None:
    secs = f"{seconds:7.1f}" if seconds is not None else " " * 7
    print(f"{name:<17} {status:<20} {secs}  {figures[:150]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of gpu_check.json, logs and scratch runs")
    parser.add_argument("--only", help=f"comma-separated checks (default all): {','.join(CHECKS)}")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"the whole run's time limit (default {BUDGET_S})")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch runs (checkpoints, traces)")
    args = parser.parse_args()
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    start = time.monotonic()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = child_env(args.device, out / "work")
    smi = nvidia_smi()
    machine = probe_machine(env)
    if "probe_error" in machine:  # torch itself failed: the checks will say how, the header records it
        print(machine["probe_error"], file=sys.stderr)
        machine["cuda_available"] = smi is not None
    device = args.device if args.device != "auto" else ("cuda" if machine["cuda_available"] else "cpu")
    if device == "cuda" and not machine["cuda_available"]:
        parser.error("--device cuda: torch sees no GPU here")
    if device == "cpu":
        env = child_env("cpu", out / "work")
    report: dict[str, Any] = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device,
        "budget_s": args.budget_s, "machine": {**machine, "nvidia_smi": smi}, "trainfit": trainfit_source(),
        "command": " ".join(sys.argv), "checks": {}}
    json_path = out / "gpu_check.json"
    print(f"gpu_check on {machine.get('device_name') or machine.get('cpu')} ({device}), torch {machine.get('torch')}, "
          f"CUDA {machine.get('cuda')}, driver {(smi or {}).get('driver_version')}, budget {args.budget_s:.0f} s",
          flush=True)
    print_row("check", "status", None, "figures")
    for name in names:
        spec = CHECKS[name]
        left = args.budget_s - (time.monotonic() - start)
        if spec.cuda_only and device != "cuda":
            entry: dict[str, Any] = {"status": "skipped: needs CUDA", "seconds": 0.0, "figures": {}}
        elif left < (spec.cuda_s if device == "cuda" else spec.cpu_s):
            entry = {"status": "skipped: budget", "seconds": 0.0, "figures": {}}
        else:
            entry = run_check(name, device, out, env, min(spec.limit_s, left))
            if not args.keep_work:
                shutil.rmtree(out / "work" / name, ignore_errors=True)
        entry["expected_s"] = spec.cuda_s if device == "cuda" else spec.cpu_s
        report["checks"][name] = entry
        report["total_seconds"] = round(time.monotonic() - start, 1)
        json_path.write_text(json.dumps(report, indent=1))
        shown = entry.get("summary", "") if entry["status"] == "ok" else last_error_line(entry)
        print_row(name, entry["status"], entry["seconds"] if entry["seconds"] else None, shown)
    if not args.keep_work:
        shutil.rmtree(out / "work", ignore_errors=True)
    failed = [n for n, e in report["checks"].items() if e["status"] == "failed"]
    print(f"total {report['total_seconds']:.1f} s; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; "
          f"wrote {json_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
