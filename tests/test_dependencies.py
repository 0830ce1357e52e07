"""CI installs a lock that covers every dependency and satisfies pyproject.toml's bounds, and the
newest-versions check runs test files that exist."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]


def _check_latest():
    spec = importlib.util.spec_from_file_location("check_latest", ROOT / "benchmarks" / "check_latest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in (*project["dependencies"], *(r for group in extras.values() for r in group))]


def test_the_lock_pins_every_dependency_within_pyproject_bounds() -> None:
    check_latest = _check_latest()
    pins = check_latest.locked_versions()
    for req in _requirements():
        name = check_latest.normalize(req.name)
        assert name in pins, f"{req.name} is a dependency but .ci/constraints.txt does not pin it"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f".ci/constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req}"


def test_ci_installs_from_the_lock() -> None:
    install = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "-e " in line]
    assert install and all("-c .ci/constraints.txt" in line for line in install)


def test_the_newest_versions_check_names_existing_tests() -> None:
    missing = [path for path in _check_latest().TESTS if not (ROOT / path).exists()]
    assert not missing, f"benchmarks/check_latest.py lists test files that do not exist: {missing}"
