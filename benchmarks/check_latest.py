"""Run the tests that lean on third-party packages against the newest versions pyproject.toml allows.

CI installs the exact versions of .ci/constraints.txt, so it tests the same packages every time; a
user's fresh `pip install -e ".[dev]"` resolves the newest releases instead (torchao, transformers,
numpy, tensorboard ...), and a new release can break what the lock still passes (torchao 0.18's
optimizers keep `lr` as a tensor, which once broke the metrics log). This script builds a fresh
virtualenv, installs torch (`--torch`, default the version this Python runs: a plain `torch` would
pull a multi-GB CUDA build), then trainfit's dev extra upgraded eagerly without the lock, prints
each package whose version differs from the lock, and runs the tests in TESTS there.

    python benchmarks/check_latest.py                 # a new virtualenv in a temporary folder
    python benchmarks/check_latest.py --venv .latest  # kept (and reused) at .latest
    python benchmarks/check_latest.py -- -x -q        # arguments after -- go to pytest

Exit status: pytest's (0 when every test passed), or 2 when the install failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / ".ci" / "constraints.txt"

TESTS = (
    "tests/unit/train/test_optim.py",
    "tests/unit/train/test_metrics.py",
    "tests/unit/test_float8.py",
    "tests/integration/test_fp8_training.py",
    "tests/unit/models/test_models_hf.py",
    "tests/unit/models/test_models_moe.py",
    "tests/test_cli.py",
)
"""Test files that exercise torchao (8-bit AdamW, float8), transformers (HF config and weights
interop), tensorboard and the CLI's end-to-end training: what a new release of a dependency breaks."""


def locked_versions(path: Path = LOCK) -> dict[str, str]:
    """{normalized package name: version} from the constraints file."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalize(name)] = version.strip()
    return pins


def normalize(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, help="virtualenv folder to create or reuse (default: a temporary one)")
    parser.add_argument("--torch", default=None, help="torch requirement (default: torch==<this Python's version>)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trainfit-latest-") as tmp:
        env_dir = args.venv or Path(tmp) / "venv"
        if not (env_dir / "bin" / "python").exists():
            venv.create(env_dir, with_pip=True)
        python = str(env_dir / "bin" / "python")
        torch_req = args.torch or f"torch=={_torch_version()}"
        hold_torch = Path(tmp) / "torch.txt"  # an eager upgrade would otherwise replace it with the newest build
        hold_torch.write_text(torch_req + "\n")
        pip = [python, "-m", "pip", "install", "--quiet"]
        if (_run([*pip, torch_req]).returncode
                or _run([*pip, "-c", str(hold_torch), "--upgrade", "--upgrade-strategy", "eager", "-e", ".[dev]"])
                .returncode):
            print("error: the install failed (see pip's output above)", file=sys.stderr)
            return 2
        listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                                check=True)
        installed = {normalize(p["name"]): p["version"] for p in json.loads(listed.stdout)}
        locked = locked_versions()
        newer = {name: (locked[name], installed[name]) for name in sorted(locked)
                 if name in installed and installed[name].split("+")[0] != locked[name].split("+")[0]}
        print(f"{len(newer)} package(s) differ from {LOCK.relative_to(ROOT)}:")
        for name, (old, new) in newer.items():
            print(f"  {name:24} {old:>14} -> {new}")
        return _run([python, "-m", "pytest", *TESTS, *args.pytest_args]).returncode


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "2.13.0"
    return torch.__version__.split("+")[0]


if __name__ == "__main__":
    sys.exit(main())
