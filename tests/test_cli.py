"""The command line, run as a user would: `python -m trainfit ...` in a subprocess."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _runs import run_config, run_overrides
from trainfit import traced
from trainfit.cli import main
from trainfit.train import checkpoint as ckpt
from trainfit.train.metrics import METRICS_FILE, read_metrics
from trainfit.train.optim import lr_at


def trainfit(*args: str, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("cli_run")
    proc = trainfit("train", *run_overrides(run_dir, "--training.steps=12", "--training.eval_interval=6"))
    return run_dir, proc


def table_row(stdout: str, first: str) -> list[str]:
    """The cells of the printed table row whose first cell is `first`."""
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in re.split("[│┃]", line)[1:-1]]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{stdout}")


def test_train_prints_a_summary_and_saves(trained_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, proc = trained_run
    assert "run complete" in proc.stdout
    assert "val loss" in proc.stdout and "tokens/s" in proc.stdout and "peak memory" in proc.stdout
    assert proc.stdout.index("run complete") < proc.stdout.index("predicted vs measured")  # the table comes after
    assert table_row(proc.stdout, "component")[1:4] == ["analytic", "traced", "measured"]
    peak = table_row(proc.stdout, "peak")  # three sizes, then the errors of the two estimates
    assert [cell.endswith("MiB") for cell in peak[1:4]] == [True] * 3 and [c[-1] for c in peak[4:]] == ["%", "%"]
    assert ckpt.latest_checkpoint(run_dir / "ckpt").name == "step_00000012"
    assert [r["step"] for r in read_metrics(run_dir / "logs") if "val_loss" in r] == [0, 6, 12]


def test_sample_continues_the_prompt(trained_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    run_dir, _ = trained_run
    proc = trainfit("sample", "--checkpoint", str(run_dir / "ckpt"), "--prompt", "ROMEO:",
                    "--max-new-tokens", "40", "--temperature", "0")
    assert proc.stdout.startswith("ROMEO:")
    assert len(proc.stdout.rstrip("\n")) > len("ROMEO:") + 10
    again = trainfit("sample", "--checkpoint", str(run_dir / "ckpt"), "--prompt", "ROMEO:",
                     "--max-new-tokens", "40", "--temperature", "0")
    assert again.stdout == proc.stdout  # greedy decoding is deterministic


def test_help_lists_every_field_with_its_doc() -> None:
    out = trainfit("train", "--help").stdout
    assert "--training.global_batch_size" in out and "gradient accumulation" in out
    assert "--memory.activation_checkpointing" in out and "--precision.mode" in out


def test_bad_config_fails_before_any_work(tmp_path: Path) -> None:
    proc = trainfit("train", "--training.micro_batch_size=0", f"--logging.dir={tmp_path}", check=False)
    assert proc.returncode == 2
    assert "training.micro_batch_size=0: must be >= 1" in proc.stderr
    assert not any(tmp_path.iterdir())
    proc = trainfit("train", "--parallel.tp=3", check=False)
    assert proc.returncode == 2 and "parallel.tp=3: must divide model.num_heads=8" in proc.stderr
    proc = trainfit("train", "not-a-file.toml", check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_prepare_data_then_train_on_the_shards(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 400)
    out = tmp_path / "shards"
    proc = trainfit("prepare-data", str(corpus), "--out", str(out))
    assert "wrote" in proc.stdout and (out / "manifest.json").is_file()
    trainfit("train", *run_overrides(tmp_path, "--training.steps=3", f"--data.path={out}"))
    assert ckpt.latest_checkpoint(tmp_path / "ckpt").name == "step_00000003"


def test_export_loads_in_transformers_with_the_same_logits(
    trained_run: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from trainfit.train.sample import load_trained_model

    run_dir, _ = trained_run
    trainfit("export", str(run_dir / "ckpt"), "--out", str(tmp_path / "hf"))
    umask = os.umask(0)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {0o666 & ~umask}  # not 0600
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # written beside it, then moved in
    trainfit("export", str(run_dir / "ckpt"), "--out", str(tmp_path / "hf"), "--force")  # replaces the files
    ours, _, _ = load_trained_model(run_dir / "ckpt", torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)


def _losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(log_dir) if "loss" in r}


def holding(module: str, attribute: str, message: str, when: str = "True") -> str:
    """A script running `trainfit` (its arguments) with `module`'s `attribute` (e.g. Trainer.train_step)
    patched: after the original call, once `when` (an expression of `args`) holds, it prints `message`
    and waits until the test closes its stdin, so where a signal lands does not depend on timing."""
    return textwrap.dedent(f"""
        import importlib, sys
        from trainfit.cli import main

        *path, name = "{attribute}".split(".")
        owner = importlib.import_module("{module}")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def held(*args, **kwargs):
            result = original(*args, **kwargs)
            if {when}:
                print("{message}", flush=True)
                sys.stdin.read()
            return result

        setattr(owner, name, held)
        raise SystemExit(main(sys.argv[1:]))
    """)


HOLD_AFTER_STEP_3 = holding("trainfit.train.trainer", "Trainer.train_step", "HOLDING AFTER STEP 3",
                            when="args[0].step == 3")


def test_sigterm_then_the_same_command_resumes_bitwise(tmp_path: Path) -> None:
    """A real process stopped by SIGTERM mid-run, restarted with the same command, ends exactly where
    an uninterrupted run does: same loss at every step, same parameters. The interrupted process holds
    after step 3 until the signal has been sent, so where it stops does not depend on timing."""
    steps = 20

    def args(run_dir: Path) -> list[str]:
        return ["train", *run_overrides(run_dir, f"--training.steps={steps}")]

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AFTER_STEP_3, *args(interrupted)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    before = []
    while (line := proc.stdout.readline()) and not line.startswith("HOLDING AFTER STEP 3"):
        before.append(line)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate()  # closes stdin: step 3 returns, and the run stops for the signal
    assert line and proc.returncode == 128 + signal.SIGTERM, "".join(before) + out  # 143, the shell's convention
    assert "stopped by SIGTERM" in out
    assert max(_losses(interrupted / "logs")) == 3
    assert ckpt.latest_checkpoint(interrupted / "ckpt").name == ckpt.step_dir_name(3)

    resumed_run = trainfit(*args(interrupted)).stdout
    assert f"{steps} / {steps} (resumed at step 3)" in resumed_run
    again = trainfit(*args(interrupted)).stdout  # the run is complete: says so, trains nothing
    assert "already complete at step 20" in again and "tokens/s" not in again
    straight = tmp_path / "straight"
    trainfit(*args(straight))
    assert _losses(interrupted / "logs") == _losses(straight / "logs")
    assert sorted(_losses(straight / "logs")) == list(range(1, steps + 1))
    a = ckpt.load_trainer_state(ckpt.latest_checkpoint(interrupted / "ckpt"))
    assert a["step"] == steps
    from trainfit.train.sample import load_trained_model

    resumed, _, _ = load_trained_model(interrupted / "ckpt", torch.device("cpu"))
    uninterrupted, _, _ = load_trained_model(straight / "ckpt", torch.device("cpu"))
    for (name, p), q in zip(resumed.state_dict().items(), uninterrupted.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_tensorboard_events_are_written(tmp_path: Path) -> None:
    trainfit("train", *run_overrides(tmp_path, "--training.steps=2", "--logging.interval=1",
                                     "--logging.tensorboard=true"))
    assert list((tmp_path / "logs" / "tensorboard").glob("events.out.tfevents.*"))


OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adamw-8bit")
ONE_SHAPE = ("--model.dim=256", "--model.num_layers=1", "--model.num_heads=4", "--model.num_kv_heads=4",
             "--model.ffn_dim=256")
"""After DEBUG_RUN: one block whose every matrix is 256 x 256, as the embedding and the output are (the
bytes vocabulary): torchao's 8-bit update compiles once per parameter shape, so twice (the matrices,
the norms' plain states) instead of six times for the debug model."""


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_logs_plain_numbers_and_resumes(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """3 steps, a checkpoint, then on to 5: every line of metrics.jsonl holds plain numbers and strings,
    the loss is finite and the lr is the schedule's at the step it was used (torchao's AdamW8bit keeps
    lr a tensor that the scheduler refills in place), in metrics.jsonl and in TensorBoard alike."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = (f"--optimizer.name={name}", *ONE_SHAPE, "--logging.tensorboard=true")
    assert main(["train", *run_overrides(tmp_path, *overrides, "--training.steps=3")]) == 0
    assert main(["train", *run_overrides(tmp_path, *overrides, "--training.steps=5")]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" in err and out.count("run complete") == 2
    lines = (tmp_path / "logs" / METRICS_FILE).read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda word: pytest.fail(f"{word} in metrics.jsonl")) for line in lines]
    assert all(type(v) in (int, float, str) or v is None for record in records for v in record.values()), lines
    steps = {r["step"]: r for r in records if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps.values())
    planned_3, planned_5 = (run_config(tmp_path, f"--training.steps={n}").training for n in (3, 5))
    schedule = [lr_at(step - 1, planned_3 if step <= 3 else planned_5) for step in range(1, 6)]
    assert [steps[step]["lr"] for step in range(1, 6)] == pytest.approx(schedule, rel=1e-6)
    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("lr")}
    assert [logged[step] for step in range(1, 6)] == pytest.approx(schedule, rel=1e-6)


def test_train_warns_once_of_a_chunked_loss_of_one_chunk(tmp_path: Path) -> None:
    """The debug run's micro-batch is 4 x 32 tokens, under the default chunk: the warning names the
    numbers, once (the traced estimate's step does not repeat it)."""
    proc = trainfit("train", *run_overrides(tmp_path, "--training.steps=1", "--memory.chunked_loss=true"))
    lines = [line for line in proc.stderr.splitlines() if "memory.chunked_loss" in line]
    assert lines == ["warning: memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens=1024 >= the 128 "
                     "tokens of a micro-batch that a rank's loss scores (4 sequences x 32 tokens), so one chunk holds "
                     "the whole logits (and is recomputed in backward); set memory.loss_chunk_tokens below 128, e.g. "
                     "32, or memory.chunked_loss=false"]


def test_train_warns_before_allocating_when_the_estimate_exceeds_the_device(tmp_path: Path) -> None:
    proc = trainfit("train", *run_overrides(tmp_path, "--training.steps=1", "--hardware.memory_gib=0.001"))
    assert "warning: the estimate needs" in proc.stderr and "0.0 GiB of cpu" in proc.stderr
    assert "predicted vs measured" in proc.stdout


def _refuse_to_trace(cfg: object, layout: object = None) -> None:
    raise RuntimeError("a layout the tracer refuses")


@pytest.mark.parametrize("tracing", ["disabled", "fails"])
def test_train_compares_the_analytic_estimate_alone_without_a_trace(
    tracing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """logging.traced_estimate=false does not trace at all; a trace that fails costs one warning line."""
    monkeypatch.setattr(traced, "trace_step", _refuse_to_trace)
    flag = "false" if tracing == "disabled" else "true"
    assert main(["train", *run_overrides(tmp_path, "--training.steps=2", f"--logging.traced_estimate={flag}")]) == 0
    out, err = capsys.readouterr()
    header = table_row(out, "component")
    assert header[1:3] == ["analytic", "measured"] and "traced" not in " ".join(header)
    assert len(table_row(out, "peak")) == 4  # analytic, measured and the analytic error
    warnings = [line for line in err.splitlines() if "traced estimate" in line]
    assert warnings == ([] if tracing == "disabled" else
                        ["warning: no traced estimate (RuntimeError: a layout the tracer refuses); "
                         "comparing the analytic one only"])


SAY_WHEN_SIGNALLED = textwrap.dedent("""
    from trainfit.train.signals import StopOnSignal

    handle = StopOnSignal._handle

    def handle_and_say(self, signum, frame):  # the test sends a second signal only once the first is seen
        handle(self, signum, frame)
        print("SIGNAL SEEN", flush=True)

    StopOnSignal._handle = handle_and_say
""")


def default_sigint() -> None:
    """In the child before exec: Ctrl-C's default action, as in a terminal. A test session started in
    the background (`pytest &` in a script) has SIGINT ignored, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _held_run(run_dir: Path, *extra: str) -> subprocess.Popen:
    """`trainfit train` holding after step 3 until its stdin closes (HOLD_AFTER_STEP_3)."""
    proc = subprocess.Popen([sys.executable, "-c", SAY_WHEN_SIGNALLED + HOLD_AFTER_STEP_3, "train",
                             *run_overrides(run_dir, "--training.steps=20", *extra)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint)
    while (line := proc.stdout.readline()) and not line.startswith("HOLDING AFTER STEP 3"):
        pass
    assert line, "the run ended before step 3"
    return proc


def test_ctrl_c_saves_and_exits_130_a_second_one_exits_at_once(tmp_path: Path) -> None:
    once = _held_run(tmp_path / "once")
    os.kill(once.pid, signal.SIGINT)
    out, _ = once.communicate()  # step 3 returns, the run saves and stops
    assert once.returncode == 130 and "stopped by SIGINT" in out, out
    assert ckpt.latest_checkpoint(tmp_path / "once" / "ckpt").name == ckpt.step_dir_name(3)

    twice = _held_run(tmp_path / "twice", "--checkpoint.interval=2")  # step 2 is saved
    os.kill(twice.pid, signal.SIGINT)
    assert twice.stdout.readline().startswith("SIGNAL SEEN")
    os.kill(twice.pid, signal.SIGINT)  # the second one interrupts the held step itself
    out, _ = twice.communicate()
    assert twice.returncode == 130 and "interrupted: stopped at once" in out and "Traceback" not in out, out
    root = tmp_path / "twice" / "ckpt"
    assert [p.name for p in root.iterdir()] == [ckpt.step_dir_name(2)]  # no half-written save
    assert ckpt.verify_checkpoint(root / ckpt.step_dir_name(2)) == []


HOLD_IN_PREPARE = holding("trainfit.train.data", "_write_splits", "HOLDING IN PREPARE")  # shards half-written


def test_ctrl_c_in_prepare_data_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_IN_PREPARE, "prepare-data", "", "--out",
                             str(tmp_path / "prepared")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)
    assert proc.stdout.readline().startswith("HOLDING IN PREPARE")
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate()
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temp sibling


def test_trainfit_alone_introduces_itself() -> None:
    out = trainfit().stdout
    assert out.startswith("trainfit: ") and "commands:" in out and "examples:" in out
    assert all(f"  {verb} " in out for verb in ("estimate", "plan", "train", "report", "measure", "sample", "export",
                                                "calibrate", "validate"))
    assert out.count("\n  trainfit ") + out.count("\n  torchrun ") == 7


def test_another_runs_checkpoint_is_refused_with_the_choices(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Same folders, another model or optimizer: a named error, no traceback, nothing loaded; measure
    never loads a training checkpoint at all."""
    assert main(["train", *run_overrides(tmp_path, "--training.steps=2")]) == 0
    for change, words in (("--model.dim=128", "model.dim=64 in the checkpoint, 128 now"),
                          ("--optimizer.name=sgd", "optimizer.name='adamw' in the checkpoint, 'sgd' now")):
        capsys.readouterr()
        assert main(["train", *run_overrides(tmp_path, "--training.steps=4", change)]) == 2
        err = capsys.readouterr().err
        assert words in err and "--checkpoint.resume=never" in err and "Traceback" not in err, err
    assert main(["measure", *run_overrides(tmp_path, "--model.dim=128")]) == 0  # from fresh weights
    capsys.readouterr()
    assert main(["train", *run_overrides(tmp_path, "--training.steps=4", "--checkpoint.resume=must")]) == 0
    assert "resumed from" in capsys.readouterr().err


def test_progress_prints_a_line_every_interval_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", *run_overrides(tmp_path, "--training.steps=4", "--logging.interval=2",
                                         "--logging.progress=true")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]
    # steps 1-2 warm up and measure memory: no throughput yet ("-"), then step 3-4's
    speeds = [re.search(r"loss \d+\.\d{4} (-|[\d,]+) tok/s ETA \d+:\d\d$", line)[1] for line in lines]
    assert speeds[0] == "-" and speeds[1] != "-", lines
