"""A bounded fuzz of `trainfit serve` on loopback: random JSON shapes, every field with hostile values
(paths, `..`, symlinks, huge and negative numbers, unicode, 10,000 fields), concurrent requests,
foreign Host and Origin headers, form bodies. Every answer is a 4xx or a named error, never a 5xx;
no file outside the shared folder is read (every open and listing audited in the server's process);
the server still answers afterwards."""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SECRET = "SECRET-b41e07"
HERE = Path(__file__).parent
REQUESTS = 1000
PATHS = 23
"""The first hostile values are paths."""
PATH_FIELDS = ("model.preset", "model.init_from", "hardware.profile", "data.path")
SEED = 20261201


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    shared, outside = root / "shared", root / "outside"
    shared.mkdir()
    outside.mkdir()
    (shared / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512}))
    (outside / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": SECRET}))
    (outside / "profile.toml").write_text(f"version = 1\n[machine]\nname = '{SECRET}'\n")
    (outside / "passwd").write_text(f"root:{SECRET}:0:0\n")
    (shared / "out.json").symlink_to(outside / "config.json")
    (shared / "out").symlink_to(outside)
    log, errors = root / "opens.log", root / "stderr.log"
    with errors.open("w") as stderr:  # a file, not a pipe: the server's log of refusals never blocks it
        proc = subprocess.Popen([sys.executable, str(HERE / "_audited_serve.py"), str(log), "serve", "--port", "0",
                                 "--files", str(shared)], stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("trainfit serve: http://localhost:"), line + errors.read_text()
        yield {"port": int(line.split()[2].rstrip("/").rsplit(":", 1)[1]), "shared": shared, "outside": outside,
               "log": log, "errors": errors}
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def hostile_values(s: dict) -> list:
    out, shared = s["outside"], s["shared"]
    paths = [str(out / "config.json"), str(out), str(out / "profile.toml"), str(out / "passwd"),
             str(shared / "out.json"), str(shared / "out" / "config.json"),
             str(shared / ".." / "outside" / "passwd"), "../" * 12 + str(out / "passwd").lstrip("/"), str(shared),
             str(shared / "config.json"), "/etc/passwd", "/dev/zero", "/proc/self/environ", ".", "..",
             "~/.ssh/id_rsa", "file:///etc/passwd", "C:\\Windows\\win.ini", "a\x00b",
             "модель/конфиг.json", "😀" * 50, "x" * 5000, str(shared) + "/" * 3 + "config.json"]
    numbers = ["1" + "0" * 40, "-1", "-9223372036854775809", "9223372036854775808", "1e308", "-1e308", "nan", "inf",
               "-inf", "0", "0x10", "1_000", "1e-320", 2**70, -(2**70), -5, 0, 3.5, 1e308, True, False]
    shapes = [None, [], {}, [1, [2, [3]]], {"a": {"b": "c"}}, "", " ", "true", "\n[model]\n"]
    return paths + numbers + shapes


def random_body(rng: random.Random, fields: list[str], s: dict) -> tuple[str, str, bytes]:
    """(method, path, body) of one random request."""
    values = hostile_values(s)
    kind = rng.random()
    if kind < 0.05:
        many = {f"model.f{i}": "1" for i in range(10_000)}
        return "POST", "/api/estimate", json.dumps({"values": many}).encode()
    if kind < 0.1:
        return "POST", rng.choice(["/api/estimate", "/api/toml", "/api/hf-config"]), rng.choice([
            b"{not json", b"\xff\xfe", b"[" * 100_000, b'{"values": ' * 20_000, b"null", b"1e999999", b'"x"'])
    if kind < 0.15:
        return "GET", rng.choice(["/api/plan/" + rng.choice(["1", "-1", "9" * 50, "..%2f..%2fetc", "%00"]),
                                  "/../../etc/passwd", "/api/schema/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd",
                                  "/" + "a" * 10_000]), b""
    body: dict = {}
    if rng.random() < 0.4:  # a config that estimates, but for one path field: the file policy's requests
        paths = [v for v in values[:PATHS]]
        body["values"] = {"model.preset": "debug", rng.choice(PATH_FIELDS): rng.choice(paths)}
        if rng.random() < 0.3:
            body["values"] = {"model.preset": "debug", "training.seq_len": str(rng.choice([64, 128]))}
    elif rng.random() < 0.9:
        body["values"] = {rng.choice(fields): rng.choice(values) for _ in range(rng.randint(1, 6))}
    if rng.random() < 0.3:
        key = rng.choice(fields).split(".")
        value = rng.choice([v for v in values if isinstance(v, str) and "\x00" not in v] or ["x"])
        body["toml"] = rng.choice([f'[{key[0]}]\n{key[1]} = {json.dumps(value)}\n', "a = " + "[" * 5000,
                                   f'[model]\npreset = "{s["outside"] / "config.json"}"\n', "\x00"])
    if rng.random() < 0.2:
        body[rng.choice(["fixes", "plan", "config_json", "profile_toml", "tokens"])] = rng.choice(values)
    if rng.random() < 0.1:
        body["plan"] = {rng.choice(["top", "tokens", "gpu_options", "max_gpus", "prices"]): rng.choice(values)}
    path = rng.choice(["/api/estimate"] * 5 + ["/api/toml", "/api/plan", "/api/plan-cancel", "/api/hf-config",
                                               "/api/profile"])
    if path == "/api/hf-config":
        body["config_json"] = rng.choice([json.dumps({"model_type": "llama", rng.choice(
            ["hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
             "num_key_value_heads", "head_dim", "rope_scaling", "max_position_embeddings"]): rng.choice(values)}),
            "{" * 3000, json.dumps(rng.choice(values))])
    if path == "/api/profile":
        body["profile_toml"] = rng.choice([f"version = 1\n[machine]\ndevice = {json.dumps(str(rng.choice(values)))}\n",
                                           "version = " + str(rng.choice(values)), "[" * 3000])
    return "POST", path, json.dumps(body).encode()


HEADERS = [{}] * 10 + [{"Host": "evil.example"}, {"Origin": "http://evil.example"}, {"Origin": "null"},
           {"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"},
           {"Content-Type": "multipart/form-data; boundary=x"}, {"Sec-Fetch-Site": "cross-site"}]


def send(port: int, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.putrequest(method, path, skip_host="Host" in headers)
        for name, value in {"Content-Type": "application/json", **headers}.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_hostile_requests_get_named_4xx_answers_and_read_no_file_outside_the_shared_folder(server) -> None:
    port = server["port"]
    status, schema = send(port, "GET", "/api/schema", b"", {})
    assert status == 200
    fields = [f"{section}.{f['name']}" for section, items in json.loads(schema)["sections"].items() for f in items]
    rng = random.Random(SEED)
    requests = [(*random_body(rng, fields, server), rng.choice(HEADERS)) for _ in range(REQUESTS)]
    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda r: (r, send(port, *r)), requests))
    seconds = time.monotonic() - start
    failures = [(r[0], r[1], r[2][:200], r[3], status, body[:300]) for r, (status, body) in answers
                if status >= 500 or SECRET.encode() in body or b"Traceback" in body]
    assert not failures, failures[:5]
    for (method, path, _, headers), (status, body) in answers:
        if path.startswith("/api/") and status != 404 or status >= 400:
            answer = json.loads(body)  # every answer is JSON: an answer, or an error with its words
            assert status == 200 or answer["error"], (path, status, answer)
        form = headers.get("Content-Type", "").startswith(("application/x-www", "text/plain", "multipart"))
        if headers.get("Host") == "evil.example" or headers.get("Origin") or method == "POST" and form \
                or headers.get("Sec-Fetch-Site") and path.startswith("/api/"):
            assert status == 403, (method, path, headers, status, body[:200])
    kinds = {status for _, (status, _) in answers}
    assert 200 in kinds and 400 in kinds and 403 in kinds, kinds  # the fuzz reached past the guard, and was refused
    estimates = sum(status == 200 and b'"per_rank"' in body for _, (status, body) in answers)
    assert estimates >= REQUESTS // 40  # and past validation, to whole estimates
    assert send(port, "GET", "/api/schema", b"", {})[0] == 200  # the server still answers
    assert send(port, "POST", "/api/estimate", json.dumps({"values": {"model.preset": str(
        server["shared"] / "config.json")}}).encode(), {})[0] == 200
    # every file the server opened or listed is Python's own, the shared folder's, or its uploads'
    lines = server["log"].read_text(encoding="utf-8").splitlines()
    roots = [*json.loads(lines[0]), str(server["shared"].resolve()), str(Path("/tmp").resolve() / "trainfit-serve-")]
    touched = {line.split("\t", 1)[1] for line in lines[1:]}
    outside = sorted(p for p in touched if not any(p == r or p.startswith(r.rstrip("/") + ("/" if not r.endswith(
        "-") else "")) for r in roots))
    assert not outside, outside[:20]
    assert not [p for p in touched if p.startswith(str(server["outside"].resolve()))]
    print(f"{REQUESTS} requests in {seconds:.1f} s; statuses {sorted(kinds)}; {estimates} estimates; "
          f"{len(touched)} files touched")


HF_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
           "vocab_size", "max_position_embeddings", "head_dim", "rope_scaling", "rope_parameters", "rope_theta",
           "rms_norm_eps", "tie_word_embeddings", "num_local_experts", "num_experts_per_tok", "sliding_window",
           "use_sliding_window", "hidden_act", "attention_bias", "mlp_bias", "router_aux_loss_coef", "n_embd",
           "n_layer", "n_head", "n_positions", "n_inner", "layer_norm_epsilon", "activation_function"]
HF_VALUES = [0, -1, 2**70, -(2**70), 1.5, "x", None, [], {}, True, 1e308, {"rope_theta": "x"},
             {"rope_type": "llama3", "factor": "x"}, "😀"]


def test_every_key_of_an_uploaded_config_json_with_hostile_values_is_a_named_error(server) -> None:
    """The upload's parser (models/hf.py) once divided by zero heads and compared a string window."""
    base = {"llama": {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
                      "max_position_embeddings": 512, "num_local_experts": 4, "num_experts_per_tok": 2},
            "gpt2": {"n_embd": 256, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 128}}
    answers = []
    for model_type in ("llama", "mixtral", "qwen2", "mistral", "gpt2"):
        for key in HF_KEYS:
            for value in HF_VALUES:
                hf = {**base["gpt2" if model_type == "gpt2" else "llama"], "model_type": model_type, key: value}
                status, body = send(server["port"], "POST", "/api/hf-config",
                                    json.dumps({"config_json": json.dumps(hf)}).encode(), {})
                answer = json.loads(body)
                assert status == 200 and ("values" in answer or answer["field"] == "model.preset"), (hf, answer)
                if "values" in answer:  # what the page does next: estimate the fields
                    status, body = send(server["port"], "POST", "/api/estimate",
                                        json.dumps({"values": answer["values"]}).encode(), {})
                    assert status == 200, (hf, body[:300])
                answers.append("values" in answer)
    assert any(answers) and not all(answers)
