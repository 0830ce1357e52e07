"""`trainfit serve` reads no file of the server's for a client unless the user who started it shared
its folder (`--files DIR`), and then only files of the kind the field reads; a refusal says the same
whatever is on the disk, and never what a file holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _server import call, running

SECRET = "SECRET-7f3a9c"
HF = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> dict[str, Path]:
    """A shared folder (a good config.json, a bad one, a profile, a weights folder, a symlink out) and,
    outside it, files the server must never read."""
    root = tmp_path_factory.mktemp("disk")
    shared, outside = root / "shared", root / "outside"
    shared.mkdir()
    outside.mkdir()
    (shared / "config.json").write_text(json.dumps(HF))
    (shared / "bad.json").write_text(json.dumps({**HF, "hidden_size": SECRET}))
    (shared / "notes.txt").write_text(json.dumps(HF))
    (shared / "model").mkdir()
    (shared / "model" / "config.json").write_text(json.dumps(HF))
    (outside / "config.json").write_text(json.dumps({**HF, "hidden_size": SECRET}))
    (outside / "secret.toml").write_text(f"version = 1\nname = '{SECRET}'\n")
    (shared / "link.json").symlink_to(outside / "config.json")
    (shared / "linkdir").symlink_to(outside)
    profile = shared / "h100.toml"
    subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--catalog", "H100-SXM-80GB", "--out", str(profile)],
                   check=True, capture_output=True, timeout=120)
    return {"root": root, "shared": shared, "outside": outside, "profile": profile}


def estimate(base: str, values: dict[str, str], toml: str = "") -> tuple[int, dict]:
    return call(base, "POST", "/api/estimate", {"toml": toml, "values": values, "fixes": False})


def refused(status: int, answer: dict, field: str) -> str:
    """The refusal's message with the value the client sent taken out (it is the client's own)."""
    assert status == 400 and answer["field"] == field, answer
    assert SECRET not in answer["error"] and "--force" not in answer["error"]
    return answer["error"].split(": ", 1)[1]


def test_without_files_a_path_is_refused_the_same_whatever_is_there(disk) -> None:
    paths = [disk["outside"] / "config.json", disk["outside"], disk["root"] / "missing.json", disk["root"] / "nowhere",
             "/etc/passwd", "/dev/zero", "../../../../etc/passwd", str(disk["shared"] / "config.json")]
    with running() as base:
        messages = {refused(*estimate(base, {"model.preset": str(p)}), "model.preset") for p in paths}
        assert len(messages) == 1 and "--files" in messages.pop()
        messages = {refused(*estimate(base, {"hardware.profile": str(p)}), "hardware.profile")
                    for p in [disk["outside"] / "secret.toml", "/etc/passwd", disk["root"] / "missing.toml"]}
        assert len(messages) == 1 and "upload the profile" in messages.pop()
        # in the TOML text as in the fields
        status, answer = estimate(base, {}, toml=f'[model]\ninit_from = "{disk["outside"]}"\n')
        refused(status, answer, "model.init_from")
        outside = {"model.preset": str(disk["outside"] / "config.json")}
        status, answer = call(base, "POST", "/api/toml", {"values": outside})
        refused(status, answer, "model.preset")
        # a bare name is an unknown preset, whether or not a folder of that name is where the server runs
        status, answer = estimate(base, {"model.preset": "src"})
        assert status == 200 and answer["field"] == "model.preset" and "unknown preset" in answer["error"]


def test_with_files_the_shared_folders_files_of_the_right_kind_are_read(disk) -> None:
    shared = disk["shared"]
    with running(files=(shared,)) as base:
        for preset in (shared / "config.json", shared / "model", shared / "model" / ".." / "config.json"):
            status, answer = estimate(base, {"model.preset": str(preset)})
            assert status == 200 and "error" not in answer, answer
            assert answer["model"]["dim"] == HF["hidden_size"]
        status, answer = estimate(base, {"hardware.gpu": "H100-SXM-80GB", "hardware.profile": str(disk["profile"])})
        assert status == 200 and "error" not in answer, answer
        # outside by `..`, by a symlink to a file or a folder, or not of the field's kind: one message
        bad = [shared / ".." / "outside" / "config.json", shared / "link.json", shared / "linkdir" / "config.json",
               shared / "linkdir", shared / "notes.txt", shared / "bad.json", shared / "missing.json",
               shared / "nothing" / ".." / "config.json"]
        messages = {refused(*estimate(base, {"model.preset": str(p)}), "model.preset") for p in bad}
        assert len(messages) == 1
        messages = {refused(*estimate(base, {"hardware.profile": str(p)}), "hardware.profile")
                    for p in (shared / "config.json", shared / "linkdir" / "secret.toml", shared / "missing.toml")}
        assert len(messages) == 1


def test_what_a_refusal_hides_from_the_client_the_servers_log_says(disk) -> None:
    shared = disk["shared"]
    proc = subprocess.Popen([sys.executable, "-m", "trainfit", "serve", "--port", "0", "--files", str(shared)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().split()[2].rstrip("/").replace("localhost", "127.0.0.1")
        status, answer = estimate(url, {"model.preset": str(shared / "bad.json")})
        refused(status, answer, "model.preset")
        estimate(url, {"model.preset": str(shared / "link.json")})
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=30)
    assert "hidden_size" in log and SECRET in log  # the reason, kept where only the user sees it
    assert f"resolves to {disk['outside'] / 'config.json'}" in log


def test_the_start_configs_own_files_are_read_without_files(disk, tmp_path) -> None:
    """The page works as before for a server started from a config that names a config.json."""
    hf = tmp_path / "config.json"
    hf.write_text(json.dumps(HF))
    toml = f'[model]\npreset = "{hf}"\n'
    with running(toml, start_raw={"model": {"preset": str(hf)}}) as base:
        status, answer = estimate(base, {}, toml=toml)
        assert status == 200 and answer["model"]["dim"] == HF["hidden_size"], answer
        refused(*estimate(base, {"model.preset": str(disk["outside"] / "config.json")}, toml=toml), "model.preset")


def test_trainfit_serve_says_what_a_host_beyond_loopback_exposes(disk) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "trainfit", "serve", "--port", "0", "--host", "0.0.0.0",
                             "--files", str(disk["shared"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "warning: --host 0.0.0.0" in err and "no login" in err and str(disk["shared"].resolve()) in err
    bad = subprocess.run([sys.executable, "-m", "trainfit", "serve", "--port", "0", "--files", str(disk["root"] / "x")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--files" in bad.stderr and "not a folder" in bad.stderr
