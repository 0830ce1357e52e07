"""`--force` is suggested, and replaces, only a file or folder of the kind the command writes: a
hardware profile for calibrate, an earlier export for export; never a file of another kind (a
client of the web page once got `calibrate --out /etc/passwd --force` as advice)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainfit.config import ConfigError
from trainfit.configure import load_config


def calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--catalog", "H100-SXM-80GB", *args],
                          capture_output=True, text=True, timeout=120)


def test_calibrate_replaces_a_profile_and_never_another_file(tmp_path: Path) -> None:
    mine = tmp_path / "passwd"
    mine.write_text("root:x:0:0:root:/root:/bin/bash\n")
    for force in ((), ("--force",)):
        proc = calibrate("--out", str(mine), *force)
        assert proc.returncode == 2 and "not a hardware profile" in proc.stderr and "--force" not in proc.stderr
    assert mine.read_text().startswith("root:x")  # untouched, --force or not
    profile = tmp_path / "h100.toml"
    assert calibrate("--out", str(profile)).returncode == 0
    again = calibrate("--out", str(profile))
    assert again.returncode == 2 and "--force" in again.stderr
    assert calibrate("--out", str(profile), "--force").returncode == 0


@pytest.mark.parametrize("content", ["root:x:0:0:root:/root:/bin/bash\n", "[model]\npreset = 'debug'\n", b"\xff\x00"])
def test_a_file_that_is_no_profile_gets_no_advice_to_overwrite_it(tmp_path: Path, content: str | bytes) -> None:
    path = tmp_path / "not-a-profile"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--hardware.profile={path}"])
    assert "--force" not in str(err.value) and "calibrate --out NEW_FILE" in str(err.value)


def test_an_older_profile_is_advised_to_be_measured_again_in_place(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text("version = 0\n[machine]\ndevice = 'cpu'\n")
    with pytest.raises(ConfigError, match=r"version 0.*--force"):
        load_config(None, [f"--hardware.profile={path}"])


def test_export_replaces_an_earlier_export_and_never_another_folder(tmp_path: Path) -> None:
    from trainfit.train.sample import _check_export_target

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(ConfigError) as err:
            _check_export_target(other, force)
        assert "not an earlier export" in str(err.value) and "--force" not in str(err.value)
    earlier = tmp_path / "export"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--force"):
        _check_export_target(earlier, False)
    _check_export_target(earlier, True)
