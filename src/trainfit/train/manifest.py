"""What a checkpoint is and what it was saved from: `manifest.json` beside its files.

The manifest records every file's size and SHA-256 (so garbled, truncated or missing files are
named at load instead of resuming silently into a diverging run) and the run's fingerprint: what a
checkpoint must agree with to be loaded into a run (the parameters' names and shapes, the
optimizer, the precision mode). Nothing about the layout is in it: a checkpoint resumes on another
world size or layout.

Torch-free: hashing, JSON and comparisons only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 1 << 20

Fingerprint = dict[str, Any]
"""{"params": {name: [shape...]}, "optimizer": name, "precision": mode, "model": the config's model section}."""


def fingerprint(param_shapes: Mapping[str, Iterable[int]], optimizer: str, precision: str,
                model_config: Mapping[str, Any]) -> Fingerprint:
    """The fingerprint of a run: what its checkpoints hold (parameters by canonical name and whole
    shape, the optimizer whose states they carry, the precision their weights are kept in); the
    model section of the config is kept to say *which* setting differs."""
    return {"params": {name: list(shape) for name, shape in sorted(param_shapes.items())},
            "optimizer": optimizer, "precision": precision, "model": dict(model_config)}


def _base_words(base: dict[str, str]) -> str:
    return f"training.seed={base['seed']}" if "seed" in base else f"model.init_from={base['init_from']!r} " \
        f"(weights {base['digest'][:12]})"


def fingerprint_differences(saved: Fingerprint, current: Fingerprint, limit: int = 3) -> list[str]:
    """What differs, in words, naming the settings (empty: the checkpoint fits this run). Parameter
    shapes decide; the model section only names the cause (a field such as rope_theta that changes
    no shape does not block a resume)."""
    differences = []
    saved_params, params = saved.get("params", {}), current["params"]
    if saved_params != params:
        fields = [f"model.{k}={saved['model'].get(k)!r} in the checkpoint, {v!r} now"
                  for k, v in current["model"].items() if saved.get("model", {}).get(k, v) != v]
        shapes = [f"{name} {saved_params.get(name, 'absent')} -> {params.get(name, 'absent')}"
                  for name in sorted(set(saved_params) | set(params)) if saved_params.get(name) != params.get(name)]
        more = f" and {len(shapes) - limit} more" if len(shapes) > limit else ""
        differences.append(("; ".join(fields) + ": " if fields else "")
                           + f"parameter shapes differ ({', '.join(shapes[:limit])}{more})")
    if saved.get("base") and current.get("base") and saved["base"] != current["base"]:
        differences.append(f"the adapters were trained on another base ({_base_words(saved['base'])} in the "
                           f"checkpoint, {_base_words(current['base'])} now)")
    for key in ("optimizer", "precision"):
        field = {"optimizer": "optimizer.name", "precision": "precision.mode"}[key]
        if key in saved and saved[key] != current[key]:
            differences.append(f"{field}={saved[key]!r} in the checkpoint, {current[key]!r} now")
    return differences


def file_digest(path: Path) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def checkpoint_files(root: Path) -> list[str]:
    """Every file of a checkpoint folder (relative, sorted), the manifest itself aside."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, step: int, files: Mapping[str, Mapping[str, Any]], fingerprint: Fingerprint) -> None:
    (root / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "fingerprint": fingerprint,
                                             "files": dict(sorted(files.items()))}, indent=1))


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, dict[str, Any]]
    fingerprint: Fingerprint


class ManifestError(ValueError):
    """The manifest is missing or unreadable: the checkpoint cannot be verified."""


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        raw = json.loads(path.read_text())
        return Manifest(step=int(raw["step"]), files=dict(raw["files"]), fingerprint=dict(raw["fingerprint"]))
    except FileNotFoundError as err:
        raise ManifestError(f"{path} is missing (saved by a trainfit before checksums, or not a checkpoint)") from err
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ManifestError(f"{path} is unreadable ({type(err).__name__}: {err})") from err


def file_problem(root: Path, name: str, expected: Mapping[str, Any]) -> str | None:
    """What is wrong with one recorded file, in words, or None when it is intact."""
    path = root / name
    if not path.is_file():
        return f"{name} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{name} has {size:,} bytes, {expected['bytes']:,} were saved (truncated or overwritten)"
    if file_digest(path)["sha256"] != expected["sha256"]:
        return f"{name} does not match its saved SHA-256 (its bytes changed on disk)"
    return None
