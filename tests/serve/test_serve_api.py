"""`trainfit serve` over HTTP: the page's questions answered with the command line's answers (the
same JSON as `trainfit estimate --json` and `trainfit plan --json` for the same config), named errors
beside their field, and every malformed request answered with a 4xx and a message, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _server import call, running
from trainfit.config import iter_fields

FITS = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "8",
        "parallel.zero_stage": "3", "training.seq_len": "4096", "training.micro_batch_size": "1",
        "precision.mode": "bf16-mixed", "memory.activation_checkpointing": "full"}
DOES_NOT_FIT = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "1"}


@pytest.fixture(scope="module")
def base():
    with running() as url:
        yield url


def cli_json(command: str, values: dict[str, str], *extra: str, config: Path | None = None) -> dict:
    args = [sys.executable, "-m", "trainfit", command, *([str(config)] if config else []), "--json", *extra,
            *(f"--{k}={v}" for k, v in values.items())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_schema_has_every_field_with_its_help_text(base) -> None:
    status, schema = call(base, "GET", "/api/schema")
    assert status == 200
    fields = {(s, f["name"]): f for s, items in schema["sections"].items() for f in items}
    assert set(fields) == {(s, n) for s, n, _, _ in iter_fields()}
    assert all(fields[(s, n)]["doc"] == doc for s, n, _, doc in iter_fields())
    mode = fields[("precision", "mode")]
    assert mode["kind"] == "choice" and "bf16-mixed" in mode["choices"]
    assert fields[("training", "seq_len")]["kind"] == "int" and fields[("training", "compile")]["kind"] == "bool"
    assert fields[("model", "dim")]["kind"] == "int" and fields[("model", "dim")]["default"] is None  # from preset
    assert fields[("peft", "targets")]["kind"] == "list"
    assert "llama3-8b" in schema["presets"] and "H100-SXM-80GB" in schema["gpus"]


@pytest.mark.parametrize("values", [FITS, DOES_NOT_FIT], ids=["fits", "does-not-fit"])
def test_the_estimate_is_the_commands(base, values: dict[str, str]) -> None:
    status, answer = call(base, "POST", "/api/estimate", {"values": values})
    assert status == 200 and "error" not in answer
    expected = cli_json("estimate", values)
    answer.pop("warnings")
    assert answer == expected
    assert answer["fits"] == (values is FITS)
    if values is DOES_NOT_FIT:  # the fixes the page offers, each a change of fields
        assert answer["fixes"] and all("=" in change for f in answer["fixes"] for change in f["changes"])


def test_a_fix_applied_fits(base) -> None:
    _, answer = call(base, "POST", "/api/estimate", {"values": DOES_NOT_FIT})
    fix = answer["fixes"][0]
    values = dict(DOES_NOT_FIT, **dict(change.split("=", 1) for change in fix["changes"]))
    _, fixed = call(base, "POST", "/api/estimate", {"values": values})
    assert fixed["fits"] and fixed["per_rank"]["peak"] + fixed["per_rank"]["reserved_margin"] == fix["memory_bytes"]


@pytest.mark.parametrize(("values", "field", "words"), [
    ({"training.seq_len": "-5"}, "training.seq_len", "training.seq_len=-5"),
    ({"training.seq_len": "abc"}, "training.seq_len", "abc"),
    ({"model.preset": "llama-99b"}, "model.preset", "llama-99b"),
    ({"precision.mode": "fp4"}, "precision.mode", "fp4"),
    ({"training.micro_batch_size": "1" + "0" * 40}, "training.micro_batch_size", "training.micro_batch_size"),
    ({"training.lr": "1e400"}, "training.lr", "training.lr"),
    ({"parallel.tp": "3", "hardware.num_gpus": "8"}, "parallel.tp", "parallel.tp=3"),
])
def test_a_bad_value_is_the_commands_named_error_beside_its_field(base, values, field, words) -> None:
    status, answer = call(base, "POST", "/api/estimate", {"values": values})
    assert status == 200
    assert answer["field"] == field and words in answer["error"]
    args = [sys.executable, "-m", "trainfit", "estimate", *(f"--{k}={v}" for k, v in values.items())]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {answer['error']}"


def test_the_toml_estimates_the_same_with_the_command(base, tmp_path) -> None:
    status, answer = call(base, "POST", "/api/toml", {"values": DOES_NOT_FIT})
    assert status == 200
    path = tmp_path / "page.toml"
    path.write_text(answer["toml"])
    _, page = call(base, "POST", "/api/estimate", {"values": DOES_NOT_FIT})
    page.pop("warnings")
    assert cli_json("estimate", {}, config=path) == page
    # and the page started from that file estimates it unchanged
    _, again = call(base, "POST", "/api/estimate", {"toml": answer["toml"], "values": {}})
    again.pop("warnings")
    assert again == page


def test_a_hugging_face_config_json_becomes_model_fields(base, tmp_path) -> None:
    hf = {"model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "intermediate_size": 1536, "vocab_size": 32000, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
    status, answer = call(base, "POST", "/api/hf-config", {"config_json": json.dumps(hf)})
    assert status == 200 and answer["values"]["model.preset"] == "" and answer["values"]["model.dim"] == "512"
    _, page = call(base, "POST", "/api/estimate", {"values": answer["values"]})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with running(files=(tmp_path,)) as shared:  # the same file read where the server may read it
        _, from_file = call(shared, "POST", "/api/estimate",
                            {"values": {"model.preset": str(tmp_path / "config.json")}})
    assert page["model"]["num_params"] == from_file["model"]["num_params"] and page["per_rank"] == from_file["per_rank"]
    for text, words in (("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                        (json.dumps({**hf, "model_type": "bert"}), "model_type='bert': not supported")):
        status, answer = call(base, "POST", "/api/hf-config", {"config_json": text})
        assert status == 200 and words in answer["error"] and answer["field"] == "model.preset"


@pytest.mark.parametrize(("method", "path", "raw", "status", "words"), [
    ("POST", "/api/estimate", b"{not json", 400, "not JSON"),
    ("POST", "/api/estimate", b"[1, 2]", 400, "send an object"),
    ("POST", "/api/estimate", b'{"values": [1]}', 400, "'values' must be an object"),
    ("POST", "/api/estimate", b'{"values": {"../x": "1"}}', 400, "a field is named section.field"),
    ("POST", "/api/estimate", b'{"values": {"training.steps": {"a": 1}}}', 400, "a value is a string"),
    ("POST", "/api/estimate", b'{"toml": 5}', 400, "'toml' must be TOML text"),
    ("POST", "/api/estimate", b'{"toml": "[training\\nsteps = "}', 200, "not valid TOML"),
    ("POST", "/api/estimate", b'\xff\xfe', 400, "not JSON"),
    ("POST", "/api/nothing", b"{}", 404, "no such request"),
    ("GET", "/etc/passwd", None, 404, "no such page"),
    ("GET", "/api/plan/abc", None, 404, "no such plan"),
    ("GET", "/api/schema?%ZZ=%%", None, 200, None),
])
def test_malformed_requests_get_a_named_error_never_a_traceback(base, method, path, raw, status, words) -> None:
    got, answer = call(base, method, path, raw=raw)
    assert got == status
    if words:
        assert words in answer["error"] and "Traceback" not in answer["error"]


def test_a_100_mb_upload_is_refused_unread(base) -> None:
    import http.client

    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/api/hf-config")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(100 << 20))
    conn.endheaders()
    conn.send(b'{"config_json": "' + b"x" * 65536)  # the start of it: the answer comes without the rest
    response = conn.getresponse()
    assert response.status == 413 and "at most" in json.loads(response.read())["error"]
    conn.close()
    assert call(base, "GET", "/api/schema")[0] == 200  # and the server goes on


def wait_plan(base: str, job: int) -> dict:
    for _ in range(1200):
        status, answer = call(base, "GET", f"/api/plan/{job}")
        assert status == 200, answer
        if answer["state"] != "running":
            return answer
        time.sleep(0.1)
    raise AssertionError("the plan did not finish in 120 s")


def test_the_plan_is_the_commands_and_a_new_one_cancels_the_old(base) -> None:
    values = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "8",
              "training.seq_len": "4096", "training.global_batch_size": "64"}
    status, started = call(base, "POST", "/api/plan", {"values": values, "plan": {"top": "5"}})
    assert status == 200
    answer = wait_plan(base, started["job"])
    assert answer["state"] == "done"
    expected = cli_json("plan", values, "--top", "5")
    got = answer["answer"]
    for run in (got, expected):
        run["search"].pop("seconds")
    assert got == expected and got["candidates"]
    # machines: slow enough to be replaced by a newer question, which cancels it
    slow = {"values": {**values, "hardware.num_gpus": "64"},
            "plan": {"tokens": "1e12", "gpu_options": "H100-SXM-80GB,A100-SXM-80GB,L4", "max_gpus": "64"}}
    first = call(base, "POST", "/api/plan", slow)[1]["job"]
    second = call(base, "POST", "/api/plan", {"values": values, "plan": {"top": "1"}})[1]["job"]
    assert call(base, "GET", f"/api/plan/{first}")[0] == 404  # replaced: only the newest is kept
    assert wait_plan(base, second)["state"] == "done"


def test_a_plan_over_machines_is_the_commands(base) -> None:
    values = {"model.preset": "debug", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "2"}
    options = {"tokens": "1e9", "gpu_options": "H100-SXM-80GB,A100-SXM-80GB", "max_gpus": "2"}
    job = call(base, "POST", "/api/plan", {"values": values, "plan": options})[1]["job"]
    answer = wait_plan(base, job)["answer"]
    expected = cli_json("plan", values, "--tokens", "1e9", "--gpu-options", options["gpu_options"], "--max-gpus", "2")
    assert answer == expected and len(answer["options"]) == 4
    bad = call(base, "POST", "/api/plan", {"values": values, "plan": {"tokens": "lots"}})[1]["job"]
    assert "must be a number" in wait_plan(base, bad)["answer"]["error"]


def test_trainfit_serve_prints_its_url_serves_the_page_and_binds_localhost(tmp_path) -> None:
    config = tmp_path / "start.toml"
    config.write_text('[model]\npreset = "debug"\n')
    proc = subprocess.Popen([sys.executable, "-m", "trainfit", "serve", str(config), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("trainfit serve: http://localhost:"), line + proc.stderr.read()
        url = line.split()[2].rstrip("/").replace("localhost", "127.0.0.1")
        status, page = call(url, "GET", "/")
        assert status == 200 and "<title>trainfit</title>" in page
        assert call(url, "GET", "/api/schema")[1]["start_toml"] == config.read_text()
        import socket

        with socket.socket() as s:  # bound to the loopback address only
            s.settimeout(2)
            assert s.connect_ex((socket.gethostbyname(socket.gethostname()), int(url.rsplit(":", 1)[1]))) != 0 \
                or socket.gethostbyname(socket.gethostname()).startswith("127.")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "trainfit", "serve", "--port", "70000"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--port 70000" in bad.stderr


def test_an_uploaded_hardware_profile_is_the_commands_profile(base, tmp_path) -> None:
    path = tmp_path / "h100.toml"
    subprocess.run([sys.executable, "-m", "trainfit", "calibrate", "--catalog", "H100-SXM-80GB", "--out", str(path)],
                   check=True, capture_output=True, timeout=120)
    status, answer = call(base, "POST", "/api/profile", {"profile_toml": path.read_text()})
    assert status == 200 and "error" not in answer, answer
    values = {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "8",
              "parallel.zero_stage": "3", **answer["values"]}
    _, page = call(base, "POST", "/api/estimate", {"values": values})
    page.pop("warnings")
    assert page == cli_json("estimate", {**values, "hardware.profile": str(path)})
    status, bad = call(base, "POST", "/api/profile", {"profile_toml": "[matmul]\nflops = 'fast'\n"})
    assert status == 200 and bad["field"] == "hardware.profile" and bad["error"]


def test_a_changed_config_cancels_the_running_plan(base) -> None:
    slow = {"values": {"model.preset": "llama3-70b", "hardware.gpu": "H100-SXM-80GB", "hardware.num_gpus": "512"},
            "plan": {"tokens": "1e12", "gpu_options": "H100-SXM-80GB,A100-SXM-80GB,L4", "max_gpus": "512"}}
    job = call(base, "POST", "/api/plan", slow)[1]["job"]
    assert call(base, "POST", "/api/plan-cancel", {})[1] == {"cancelled": 1}
    assert wait_plan(base, job)["state"] == "cancelled"
