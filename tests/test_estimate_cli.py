"""`trainfit estimate` as a user runs it: JSON schema, readable table, advice, plot, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainfit.cli import main
from trainfit.configure import load_config
from trainfit.estimate import estimate as estimate_config
from trainfit.plan.fixes import fewest_changes

EXAMPLES = Path(__file__).parents[1] / "examples"
BYTE_KEYS = ("params", "master_params", "grads", "optimizer", "activations", "logits", "buffers", "peak",
             "reserved_margin", "device_memory")


def estimate(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainfit", "estimate", *args], capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_json_schema_for_the_gpu_example() -> None:
    out = json.loads(estimate(str(EXAMPLES / "llama3-8b-8xh100.toml"), "--json").stdout)
    assert set(out) == {"model", "per_rank", "per_stage", "flops", "time", "fits", "attention_kernel",
                        "derived_defaults"}
    assert out["attention_kernel"] == "fused"
    assert out["model"]["num_params"] == 8_030_261_248
    rank = out["per_rank"]
    for key in BYTE_KEYS:
        assert isinstance(rank[key], int) and rank[key] >= 0, key
    assert rank["peak"] >= rank["params"] + rank["grads"] + rank["optimizer"]
    assert rank["peak_phase"] in ("forward", "backward", "optimizer")
    assert rank["layout"]["dp_shard"] == 8 and rank["layout"]["zero_stage"] == 3
    assert len(out["per_stage"]) == 1 and out["per_stage"][0]["peak"] == rank["peak"]
    assert out["fits"] is True and rank["fits"] is True
    assert out["flops"]["hardware_flops_per_step"] >= out["flops"]["model_flops_per_step"] > 0
    assert 0 < out["time"]["mfu"] < 1 and out["time"]["step_time_s"] > 0


def test_the_reserved_margin_shows_its_terms_nccls_buffers_among_them(capsys: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the margin is the CUDA context, the allocator's fragmentation and NCCL's buffers
    (memory/closed_form/comm_buffers.py), each a row under it and a key of margin_terms, summing to it; on the
    CPU it is 0 with no terms, as before NCCL's buffers were estimated."""
    monkeypatch.setenv("COLUMNS", "200")
    gpu = ["--model.preset=llama3-8b", "--hardware.gpu=H100", "--hardware.num_gpus=8", "--parallel.tp=2",
           "--parallel.zero_stage=3", "--training.micro_batch_size=1", "--training.global_batch_size=4"]
    assert main(["estimate", *gpu]) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in capsys.readouterr().out.splitlines() if line.startswith("│")}
    assert rows["cuda_context"] == "500.0 MiB"
    assert rows["comm_buffers (NCCL)"] == "661.5 MiB"  # 3 groups x 24 channels x 9.19 MiB (world, dp_shard, tp)
    assert main(["estimate", *gpu, "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["per_rank"]
    assert set(rank["margin_terms"]) == {"cuda_context", "allocator_fragmentation", "comm_buffers"}
    assert sum(rank["margin_terms"].values()) == rank["reserved_margin"]
    cpu = [arg for arg in gpu if not arg.startswith("--hardware.gpu")]
    assert main(["estimate", *cpu]) == 0
    table = capsys.readouterr().out
    assert "reserved_margin" in table and "comm_buffers" not in table and "cuda_context" not in table
    assert main(["estimate", *cpu, "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["per_rank"]
    assert (rank["reserved_margin"], rank["margin_terms"]) == (0, {})


def test_pipeline_stages_are_reported_apart() -> None:
    out = json.loads(estimate("--model.preset=llama2-7b", "--hardware.gpu=A100-SXM-80GB", "--hardware.num_gpus=8",
                              "--parallel.pp=4", "--parallel.tp=2", "--training.micro_batch_size=1",
                              "--training.global_batch_size=16", "--training.seq_len=4096",
                              "--precision.mode=bf16-mixed", "--json").stdout)
    stages = out["per_stage"]
    assert len(stages) == 4
    assert out["per_rank"]["peak"] == max(s["peak"] for s in stages)
    assert out["per_rank"]["stage"] == max(range(4), key=lambda i: stages[i]["peak"])


@pytest.mark.parametrize(("schedule", "micro_batches"), [("1f1b", 2), ("interleaved-1f1b", 2), ("dualpipev", 4)])
def test_a_pipeline_of_a_large_model_left_at_its_defaults_derives_a_batch_its_schedule_takes(
        schedule: str, micro_batches: int) -> None:
    """One sequence per rank is a large model's default micro-batch; with pipeline stages the derived
    global batch gives each data-parallel rank the fewest micro-batches the schedule takes (it once
    derived one, which no schedule takes: a named error for a config the user had not got wrong)."""
    args = ["--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8", "--parallel.pp=2",
            f"--parallel.pp_schedule={schedule}"]
    out = json.loads(estimate(*args, "--json").stdout)
    assert f"training.global_batch_size={micro_batches * 4} ({micro_batches} micro-batches of 1" in \
        " ".join(out["derived_defaults"])
    assert out["time"]["num_microbatches"] == micro_batches and len(out["per_stage"]) == 2
    written = json.loads(estimate(*args, "--training.global_batch_size=64", "--json").stdout)
    assert not any("global_batch_size" in d for d in written["derived_defaults"])  # set: never changed


def test_a_config_that_does_not_fit_gets_advice() -> None:
    out = estimate("--model.preset=llama3-70b", "--hardware.gpu=A100-40GB", "--hardware.num_gpus=8",
                   "--precision.mode=bf16-mixed", "--training.seq_len=4096", "--training.micro_batch_size=1",
                   "--training.global_batch_size=8").stdout
    assert "does not fit" in out and "peak in the" in out
    # more than two choices change here: the planner's fastest layouts, each with what it changes
    assert "the fewest changes that fit" in out and "parallel.zero_stage=3" in out and "tokens/s" in out


ISSUE = ("--model.preset=llama3-70b", "--hardware.num_gpus=1", "--hardware.gpu=H100-SXM-80GB")
"""The question most users ask first: no global batch, so the run derives it (a 70B model's default micro-batch
of 1 x 1 rank = 1 sequence: configure/defaults.py)."""


def as_overrides(changes: list[str]) -> list[str]:
    """A fix's changes ("parallel.tp=8 parallel.sequence_parallel=true", one choice each) as the
    --section.field=value overrides a user types."""
    return [f"--{token}" for words in changes for token in words.split()]


@pytest.mark.parametrize(("args", "micro", "ranks"), [
    (ISSUE, 1, 1),  # more than two changes: the planner's fastest layouts
    # one or two changes, some of a degree (context parallelism over all 8 ranks leaves 1 data-parallel one)
    (("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8", "--training.seq_len=8192",
      "--training.micro_batch_size=4", "--precision.mode=bf16-mixed"), 4, 8),
])
def test_a_config_without_a_global_batch_gets_fixes_at_the_derived_one(
        args: tuple[str, ...], micro: int, ranks: int, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns off a terminal
    batch = micro * ranks
    assert main(["estimate", *args]) == 0
    table = capsys.readouterr().out
    assert "memory per GPU" in table and "peak in the" in table and "does not fit" in table
    rank_words = f"{ranks} data-parallel rank" + "s" * (ranks > 1)
    sequences = f"{batch} sequence" + "s" * (batch != 1)
    assert f"fixes keep the global batch of {sequences} (derived: micro_batch_size {micro} x {rank_words})" \
        in table
    assert "the fewest changes that fit" in table and "tokens/s" in table
    assert main(["estimate", *args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["per_rank"]["layout"]["grad_accum_steps"] == 1
    assert out["fixes_global_batch"] == {"global_batch_size": batch, "derived": True, "micro_batch_size": micro,
                                         "data_parallel_ranks": ranks}
    assert out["fixes"]
    # each fix, typed as overrides beside the batch it kept, is what the list says: fits, at the same speed
    for fix in out["fixes"]:
        fixed = estimate_config(load_config(None, [*args, f"--training.global_batch_size={batch}",
                                                   *as_overrides(fix["changes"])]))
        assert fixed.fits, fix["changes"]
        assert fixed.perf.time["tokens_per_second"] == fix["tokens_per_second"], fix["changes"]
        assert fixed.memory_bytes == fix["memory_bytes"], fix["changes"]
    # and the library's fixes run that batch, whatever micro-batch and degrees they change
    fixes = fewest_changes(load_config(None, list(args)))
    assert [f.changes for f in fixes] == [tuple(f["changes"]) for f in out["fixes"]]
    assert all(f.candidate.layout.global_batch_size == batch for f in fixes)


def test_a_set_global_batch_is_the_one_the_fixes_keep(capsys: pytest.CaptureFixture) -> None:
    assert main(["estimate", *ISSUE, "--training.global_batch_size=32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fixes_global_batch"] == {"global_batch_size": 32, "derived": False}
    assert out["fixes"] and out["per_rank"]["layout"]["grad_accum_steps"] == 32  # the 70B model's micro-batch of 1


def test_every_example_config_estimates(tmp_path: Path) -> None:
    for path in sorted(EXAMPLES.glob("*.toml")):
        estimate(str(path), "--plot", str(tmp_path / f"{path.stem}.png"))
        assert (tmp_path / f"{path.stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_estimate_never_imports_torch() -> None:
    code = ("import sys; from trainfit.cli import main; "
            "main(['estimate', '--model.preset=llama3-70b', '--hardware.num_gpus=64', '--hardware.gpu=H100-SXM-80GB',"
            " '--parallel.tp=8', '--parallel.zero_stage=3', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.preset=llama3-8b", "--hardware.num_gpus=8", "--parallel.tp=3"],
         "parallel.tp=3: must divide model.num_heads=32"),
        (["--model.preset=llama3-8b", "--hardware.num_gpus=6", "--parallel.tp=4"],
         "hardware.num_gpus=6: must be a multiple of tp x pp x cp"),
        (["--hardware.gpu=H300"], "hardware.gpu='H300': unknown device"),
    ],
)
def test_impossible_layouts_fail_clearly(args: list[str], message: str) -> None:
    proc = estimate(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_chunked_loss_of_one_chunk_is_warned_about_with_the_numbers() -> None:
    shape = ("--training.micro_batch_size=8", "--training.seq_len=256", "--memory.chunked_loss=true")
    one = estimate(*shape, "--memory.loss_chunk_tokens=2048")
    assert ("warning: memory.chunked_loss=true saves no memory: memory.loss_chunk_tokens=2048 >= the 2048 tokens of "
            "a micro-batch that a rank's loss scores (8 sequences x 256 tokens)") in one.stderr
    assert "set memory.loss_chunk_tokens below 2048, e.g. 512, or memory.chunked_loss=false" in one.stderr
    assert "warning" not in estimate(*shape, "--memory.loss_chunk_tokens=2047").stderr


def test_eager_fp8_says_its_casts_run_as_kernels_of_their_own(capsys: pytest.CaptureFixture) -> None:
    """The estimate says how fp8-mixed's casts are priced, and when eager fp8 is predicted to trail bf16."""
    run = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
           "--parallel.zero_stage=3", "--training.seq_len=4096", "--training.micro_batch_size=1",
           "--training.global_batch_size=8")

    def printed(*args: str) -> str:
        assert main(["estimate", *run, *args]) == 0
        return " ".join(capsys.readouterr().out.split())  # the console's line breaks undone

    eager = printed("--precision.mode=fp8-mixed")
    assert "fp8-mixed without training.compile: torchao's casts run as separate kernels" in eager
    assert "predicted slower than bf16-mixed here" in eager and "fp8 casts (in compute)" in eager
    compiled = printed("--precision.mode=fp8-mixed", "--training.compile=true")
    assert "fp8-mixed under training.compile: torchao's casts to fp8 assumed fused" in compiled
    assert "slower than bf16" not in compiled
    assert "fp8" not in printed("--precision.mode=bf16-mixed")


@pytest.mark.parametrize("gpu", ["B200", "GB200", "B300", "H800-SXM-80GB", "MI325X", "L4", "RTX-A6000"])
def test_estimate_runs_on_each_newer_catalog_device(gpu: str, capsys: pytest.CaptureFixture) -> None:
    args = ["--model.preset=llama3-8b", f"--hardware.gpu={gpu}", "--hardware.num_gpus=8",
            "--training.global_batch_size=64", "--training.micro_batch_size=1", "--json"]
    assert main(["estimate", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_rank"]["device_memory"] > 0
