"""Which machine and which code produced a set of measurements: the header of `trainfit validate`'s
JSON and of benchmarks/gpu_check.py's.

The torch-free parts (nvidia-smi, the trainfit source) run in the driver, which must not hold a CUDA
context while its points run; `environment()` and `device_info()` import torch and run in a process
of their own: `python -m trainfit.validate.machine` prints both as one JSON object.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainfit.validate.grid import DeviceInfo

PACKAGE = Path(__file__).resolve().parents[1]
"""src/trainfit (or the installed package)."""
FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with fp8 tensor cores (Ada, Hopper and later)."""


def run_quiet(*cmd: str) -> str | None:
    """A command's stdout, or None when it is missing or fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def nvidia_smi() -> dict[str, Any] | None:
    """The driver's version and the GPUs as nvidia-smi lists them; None without it."""
    out = run_quiet("nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader")
    if not out:
        return None
    lines = out.splitlines()
    driver, name, memory = ([part.strip() for part in lines[0].split(",")] + ["", "", ""])[:3]
    return {"driver_version": driver, "name": name, "memory_total": memory, "gpus": len(lines), "raw": out}


def trainfit_source() -> dict[str, Any]:
    """The git commit the package was imported from (when it is a checkout) and a digest of its .py
    files (always): which code ran."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE.parent)).encode() + b"\0" + path.read_bytes())
    status = run_quiet("git", "-C", str(PACKAGE), "status", "--porcelain", "--untracked-files=no")
    return {"commit": run_quiet("git", "-C", str(PACKAGE), "rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None, "src_sha256": digest.hexdigest()}


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def environment() -> dict[str, Any]:
    """This machine's torch and device, as the results name them."""
    import importlib.metadata

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    for package in ("torchao",):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if torch.cuda.is_available():
        reads = {"device_name": lambda: torch.cuda.get_device_name(0), "device_count": torch.cuda.device_count,
                 "capability": lambda: ".".join(map(str, torch.cuda.get_device_capability(0))),
                 "cudnn": torch.backends.cudnn.version, "nccl": lambda: str(torch.cuda.nccl.version())}
        for key, read in reads.items():
            try:
                info[key] = read()
            except Exception as err:  # one unreadable figure must not cost the run its header
                info[key] = first_line(err)
    return info


def device_info(kind: str) -> DeviceInfo:
    """What the grid needs of this process's device: `kind` is cuda or cpu."""
    import importlib.util

    import torch

    from trainfit.hardware import catalog_gpu_of

    torchao = importlib.util.find_spec("torchao") is not None
    if kind == "cpu":
        compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++") or shutil.which("clang++")
        return DeviceInfo("cpu", platform.processor() or platform.machine(),
                          fp8_reason="no fp8 hardware: the CPU only emulates fp8 matmuls",
                          compile_reason=None if compiler else "torch.compile on the CPU needs a C++ compiler "
                                                               "(g++ or clang++) on PATH")
    name = torch.cuda.get_device_name(0)
    capability = torch.cuda.get_device_capability(0)
    fp8 = None
    if capability < FP8_CAPABILITY:
        fp8 = (f"no fp8 hardware: compute capability {capability[0]}.{capability[1]} "
               f"(fp8 matmuls need {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later)")
    elif not torchao:
        fp8 = "fp8-mixed needs torchao: pip install torchao"
    triton = importlib.util.find_spec("triton") is not None
    return DeviceInfo("cuda", name, torch.cuda.mem_get_info(0)[1], catalog_gpu_of(name), fp8_reason=fp8,
                      compile_reason=None if triton else "torch.compile on CUDA needs triton: pip install triton")


def probe(kind: str, env: dict[str, str]) -> tuple[dict[str, Any], DeviceInfo | None]:
    """(environment(), device_info(kind)) from a process of its own, so that this one holds no CUDA
    context; kind "auto" is cuda where torch sees a GPU. On failure: the error as environment's
    "probe_error" and no device."""
    proc = subprocess.run([sys.executable, "-m", "trainfit.validate.machine", kind], capture_output=True, text=True,
                          env=env)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"probe_error": f"exit code {proc.returncode}\n" + (proc.stdout + proc.stderr)[-3000:]}, None
    return found["environment"], DeviceInfo(**found["device"]) if found["device"] else None


def main() -> int:
    """`python -m trainfit.validate.machine [auto|cuda|cpu]`: environment() and device_info() as JSON."""
    import dataclasses

    import torch

    kind = sys.argv[1] if len(sys.argv) > 1 else "auto"
    env = environment()
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = None
    if kind == "cpu" or torch.cuda.is_available():
        try:
            device = dataclasses.asdict(device_info(kind))
        except Exception as err:  # the environment still describes the machine
            env["device_error"] = first_line(err)
    print(json.dumps({"environment": env, "device": device}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
