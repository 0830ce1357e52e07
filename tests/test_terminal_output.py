"""The first minutes at the terminal (the commands' tables in an 80-column terminal and piped to a
file): no number is ever split across lines, every suggested fix is a real change printed as it is
typed, and a comparison of devices says what it rests on."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from trainfit.configure import load_config, read_raw
from trainfit.configure.load import config_from_dict
from trainfit.units import fmt_bytes

MACHINES = ("plan", "--model.preset=llama3-8b", "--training.seq_len=8192", "--training.global_batch_size=512",
            "--tokens", "1e12", "--gpu-options", "H100-SXM-80GB,A100-SXM-80GB,MI300X", "--max-gpus", "16")
"""The issue's command (at up to 16 GPUs, to keep it short): its table is ~130 columns wide."""
DOES_NOT_FIT = ("estimate", "--model.preset=llama3-70b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                "--training.seq_len=8192", "--training.global_batch_size=64", "--training.micro_batch_size=1",
                "--precision.mode=bf16-mixed")
PLAN = ("plan", "--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
        "--training.global_batch_size=64", "--top", "5")


@functools.cache
def piped(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True, env=env,
                          check=True, timeout=300).stdout


def in_terminal(*args: str, columns: int = 80) -> str:
    """The command's output in a pseudo-terminal `columns` wide, as a person at one sees it."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trainfit", *args], stdout=child, stderr=subprocess.DEVNULL,
                            env=env, close_fds=True)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed its side
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=300) == 0
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", text)  # what the screen shows: no escapes


@functools.cache
def json_of(*args: str) -> dict:
    return json.loads(piped(*args, "--json"))


def assert_whole(text: str, numbers: list[str]) -> None:
    assert numbers
    for number in numbers:
        assert number in text, f"{number!r} is not printed whole:\n{text}"


@pytest.mark.parametrize("show", [piped, in_terminal], ids=["piped", "80-column terminal"])
def test_the_machine_comparison_never_splits_a_number(show) -> None:
    text = show(*MACHINES)
    options = [o for o in json_of(*MACHINES)["options"] if o["candidate"]]
    shown = [o for o in options if o["on_cost_frontier"]]
    assert_whole(text, [f"{o['candidate']['tokens_per_second']:,.0f}" for o in shown])
    assert_whole(text, [f"${o['cost']:,.0f}" for o in shown])
    if show is in_terminal:
        assert max(len(line) for line in text.splitlines()) <= 80
    assert "compared on published figures" in " ".join(text.split())  # what the comparison rests on
    assert "MI300X: MAMF table" in " ".join(text.split())


@pytest.mark.parametrize("show", [piped, in_terminal], ids=["piped", "80-column terminal"])
def test_estimate_and_plan_tables_never_split_a_number(show) -> None:
    text = show(*DOES_NOT_FIT)
    out = json_of(*DOES_NOT_FIT)
    assert_whole(text, [fmt_bytes(out["per_rank"][c]) for c in ("params", "optimizer", "activations")])
    assert_whole(text, [f"{out['time']['tokens_per_second']:,.0f}"])
    text = show(*PLAN)
    plan = json_of(*PLAN)
    assert_whole(text, [f"{c['tokens_per_second']:,.0f}" for c in plan["candidates"]])


@pytest.mark.parametrize("args", [
    DOES_NOT_FIT, ("estimate", "--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB"),
    ("estimate", "--model.preset=llama3-70b", "--hardware.gpu=A100-SXM-80GB", "--hardware.num_gpus=16",
     "--precision.mode=bf16-mixed")])
def test_every_suggested_fix_is_a_real_change_typed_as_an_override(args) -> None:
    out = json_of(*args)
    fixes = out["fixes"] + out.get("method_changes", [])
    assert fixes
    base = read_raw(None, list(args[1:]))
    batch = out["fixes_global_batch"]["global_batch_size"]
    original = load_config(None, [*args[1:], f"--training.global_batch_size={batch}"])
    seen = []
    for fix in fixes:
        assert fix["overrides"] == [f"--{t}" for change in fix["changes"] for t in change.split()]
        raw = read_raw(None, [*args[1:], f"--training.global_batch_size={batch}", *fix["overrides"]])
        config_from_dict(raw)  # each parses as the command line parses it
        for override in fix["overrides"]:
            key, _, value = override[2:].partition("=")
            assert value not in ("True", "False"), override
            section, name = key.split(".")
            assert getattr(getattr(original, section), name) != raw[section][name], f"{override}: no change"
        seen.append(" ".join(sorted(fix["overrides"])))
    assert len(seen) == len(set(seen))
    text = piped(*args)
    for fix in out["fixes"]:
        assert " ".join(fix["overrides"]) in text  # printed exactly as typed
    assert base  # (the config as given)


def test_offloading_optimizer_and_params_under_zero3_is_offered_once() -> None:
    out = json_of("estimate", "--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB")
    offloads = [f for f in out["fixes"] if any("memory.offload" in c for c in f["changes"])]
    zero3 = [f for f in offloads if "--parallel.zero_stage=3" in f["overrides"]]
    assert len(zero3) == 1 and zero3[0]["overrides"] == ["--parallel.zero_stage=3", "--memory.offload=optimizer"]


LLAMA_ON_8 = ("--model.preset=llama3-8b", "--hardware.num_gpus=8", "--hardware.gpu=H100-SXM-80GB",
              "--training.global_batch_size=64")


def test_defaults_follow_the_model_and_device_and_estimate_says_so() -> None:
    """The issue's command: the tiny default's 16 sequences per rank x 8 ranks exceeded the batch of 64."""
    out = json_of("estimate", *LLAMA_ON_8)
    assert out["derived_defaults"] == [
        "training.micro_batch_size=1 (one sequence per rank; trainfit plan searches larger ones)",
        "training.seq_len=8192 (the model's context, at most 8,192)",
        "precision.mode=bf16-mixed (bf16 autocast, as GPU training runs)"]
    assert out["per_rank"]["layout"]["grad_accum_steps"] == 8
    assert "defaults for this model and device" in piped("estimate", *LLAMA_ON_8)
    cfg = load_config(None, list(LLAMA_ON_8))  # what train runs: the same
    assert (cfg.training.micro_batch_size, cfg.training.seq_len, cfg.precision.mode) == (1, 8192, "bf16-mixed")
    # what the user sets stays; the tiny and debug models keep the schema's defaults; a CPU keeps fp32
    mine = load_config(None, [*LLAMA_ON_8, "--training.micro_batch_size=2", "--training.seq_len=2048"])
    assert (mine.training.micro_batch_size, mine.training.seq_len) == (2, 2048)
    for args in ([], ["--model.preset=debug"], ["--model.preset=gpt2", "--hardware.gpu=H100-SXM-80GB"]):
        small = load_config(None, args)
        assert (small.training.micro_batch_size, small.training.seq_len, small.precision.mode) == (16, 128, "fp32")
    assert load_config(None, ["--model.preset=llama3-8b"]).precision.mode == "fp32"


@pytest.mark.parametrize("command", ["report", "measure"])
def test_the_measured_tables_read_whole_at_80_columns_and_piped(command: str) -> None:
    """report's and measure's tables (a real step of the debug model): within 80 columns in a terminal,
    each table one line per row and of one width when piped."""
    args = (command, "--model.preset=debug", "--steps", "2")
    assert max(len(line) for line in in_terminal(*args).splitlines()) <= 80
    tables, table = [], []
    for line in piped(*args).splitlines():
        if line[:1] in "┏┃┡│└":
            table.append(line.rstrip())
        elif table:
            tables.append(table)
            table = []
    tables += [table] if table else []
    assert tables
    for rows in tables:
        assert len({len(line) for line in rows}) == 1, rows  # intact: every line of a table one width
