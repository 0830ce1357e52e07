"""`trainfit plan` as a user runs it: the table, --json, --out (a config `trainfit train` runs as
is), --plot, nothing that fits, and no torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from _runs import run_overrides
from trainfit.cli import main
from trainfit.configure import load_config
from trainfit.estimate import estimate

LLAMA8B_8 = ("--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
             "--training.seq_len=8192", "--training.global_batch_size=64")


def plan(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "trainfit", "plan", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_the_table_json_and_the_written_winner(tmp_path: Path) -> None:
    table = plan(*LLAMA8B_8, "--top", "4").stdout
    assert "trainfit plan: llama3-8b" in table and "FSDP" in table and "less memory" in table
    assert "searched" in table and "layouts" in table
    out = tmp_path / "plan.toml"
    proc = plan(*LLAMA8B_8, "--top", "4", "--json", "--out", str(out))
    result = json.loads(proc.stdout)
    assert set(result) == {"candidates", "global_batch", "search"} and 1 <= len(result["candidates"]) <= 4
    assert result["global_batch"] == {"global_batch_size": 64, "derived": False}
    assert "derived" not in proc.stderr
    first = result["candidates"][0]
    assert first["memory_bytes"] <= first["device_memory"] and 0 < first["mfu"] < 1
    assert f"wrote {out}" in proc.stderr
    written = estimate(load_config(out))
    assert written.fits and written.perf.time["step_time_s"] == first["step_time_s"]
    assert written.layout.dp_shard == first["settings"]["parallel.dp_shard"]


def test_a_newcomers_plan_keeps_the_derived_batch_and_writes_it(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainfit plan --out plan.toml` on the default config (no global batch): the batch `trainfit
    train` derives (micro_batch_size 16 x 1 rank) is planned, named, and written into plan.toml, whose
    winner runs another micro-batch (so leaving the batch at 0 there would derive another)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    derived = "global batch: 16 sequences (derived: micro_batch_size 16 x 1 data-parallel rank)"
    assert main(["plan", "--out", "plan.toml"]) == 0
    table = capsys.readouterr().out
    assert derived in table and "global batch 16 x 128 tokens" in table and "wrote plan.toml" in table
    cfg = load_config(tmp_path / "plan.toml")
    assert cfg.training.global_batch_size == 16
    written = estimate(cfg)
    assert written.fits and written.layout.global_batch_size == 16
    assert main(["plan", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert derived in captured.err
    assert result["global_batch"] == {"global_batch_size": 16, "derived": True, "micro_batch_size": 16,
                                      "data_parallel_ranks": 1}
    first = result["candidates"][0]
    assert written.perf.time["step_time_s"] == first["step_time_s"]
    assert first["settings"]["training.micro_batch_size"] * first["grad_accum_steps"] == 16


def test_a_derived_batch_nothing_fits_or_no_layout_takes_exits_clearly(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--model.preset=llama3.1-405b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                 "--training.seq_len=8192", "--training.micro_batch_size=16", "--memory.offload=none"]) == 1
    assert ("no layout of this model fits 8 x H100-SXM-80GB with global batch 128 sequences (derived: "
            "micro_batch_size 16 x 8 data-parallel ranks)") in capsys.readouterr().err
    # a pipeline fixed at 2 ranks and a derived batch of 1 sequence (a small model's: a large one's defaults
    # derive a batch the pipeline takes): no layout is valid, build_layout says why
    assert main(["plan", "--model.preset=debug", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=2",
                 "--parallel.pp=2", "--training.micro_batch_size=1"]) == 2
    assert "training.global_batch_size=1: each of the 1 data-parallel ranks runs 1 sequences" in capsys.readouterr().err
    # degrees that do not divide the world: deriving the batch fails with build_layout's named error
    assert main(["plan", "--hardware.num_gpus=6", "--parallel.tp=4"]) == 2
    assert "hardware.num_gpus=6: must be a multiple of tp x pp x cp = 4 x 1 x 1 = 4" in capsys.readouterr().err


def test_plan_never_imports_torch() -> None:
    code = ("import sys; from trainfit.cli import main; "
            f"assert main(['plan', *{list(LLAMA8B_8)!r}, '--top', '2']) == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_nothing_fits_exits_1_and_says_what_to_change() -> None:
    proc = plan("--model.preset=llama3.1-405b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8",
                "--training.seq_len=8192", "--training.global_batch_size=8", "--memory.offload=none", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no layout of this model fits" in proc.stderr and "does not fit" in proc.stderr
    assert "hardware.num_gpus" in proc.stderr


def test_a_cpu_plan_trains_as_written(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A plan for this machine under a memory budget that rules out the plain step: the written
    config trains as is (only the run's folders and length given beside it)."""
    out, picture = tmp_path / "plan.toml", tmp_path / "plan.png"
    budget = ("--model.preset=debug", "--training.seq_len=128", "--training.global_batch_size=8",
              "--hardware.memory_gib=0.03")
    assert main(["plan", *budget, "--top", "3", "--out", str(out), "--plot", str(picture), "--traced", "1",
                 "--json"]) == 0
    assert picture.stat().st_size > 0
    first = json.loads(capsys.readouterr().out)["candidates"][0]
    # the traced estimator's figure for the winner: within the budget, as the analytic one says
    assert abs(first["traced_memory_bytes"] / first["memory_bytes"] - 1) < 0.03
    assert first["traced_memory_bytes"] <= first["device_memory"]
    cfg = load_config(out)
    assert estimate(cfg).fits
    assert cfg.memory.activation_checkpointing != "none" or cfg.memory.chunked_loss  # the budget bit
    run = run_overrides(tmp_path / "run", "--training.steps=2", base=())
    assert main(["train", str(out), *run]) == 0


def test_estimate_of_a_config_that_does_not_fit_names_the_fewest_changes() -> None:
    args = [*LLAMA8B_8, "--training.micro_batch_size=2", "--precision.mode=bf16-mixed"]
    table = subprocess.run([sys.executable, "-m", "trainfit", "estimate", *args], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, check=True).stdout
    assert "does not fit" in table and "the fewest changes that fit" in table and "parallel.tp=8" in table
    out = json.loads(subprocess.run([sys.executable, "-m", "trainfit", "estimate", *args, "--json"],
                                    capture_output=True, text=True, check=True).stdout)
    assert out["fits"] is False and out["fixes"][0]["changes"] == ["parallel.tp=8 parallel.sequence_parallel=true"]
    assert out["fixes"][0]["overrides"] == ["--parallel.tp=8", "--parallel.sequence_parallel=true"]
    assert out["fixes"][0]["memory_bytes"] <= out["per_rank"]["device_memory"]


def test_machines_compared_by_time_and_cost(tmp_path: Path) -> None:
    picture = tmp_path / "machines.png"
    proc = plan(*LLAMA8B_8[:1], *LLAMA8B_8[3:], "--tokens", "1e11", "--gpu-options", "H100-SXM-80GB,MI300X",
                "--max-gpus", "16", "--prices", "MI300X=2.0", "--json", "--plot", str(picture))
    options = json.loads(proc.stdout)["options"]
    assert {(o["gpu"], o["num_gpus"]) for o in options} == {(g, n) for g in ("H100-SXM-80GB", "MI300X")
                                                            for n in (1, 2, 4, 8, 16)}
    assert all(o["cost"] is not None for o in options if o["candidate"])  # both priced
    assert any(o["on_cost_frontier"] for o in options) and picture.stat().st_size > 0
    table = plan(*LLAMA8B_8[:1], *LLAMA8B_8[3:], "--tokens", "1e11", "--gpu-options", "H100-SXM-80GB,MI355X",
                 "--max-gpus", "16").stdout
    assert "time to train" in table and "no price" in table  # MI355X has no indicative price


def test_machines_compared_without_a_global_batch_train_one_batch(capsys: pytest.CaptureFixture) -> None:
    """--tokens with no global batch: derived once from the config as given (16 x its 1 GPU), the
    same 16 sequences per step on every device and count, so the times compare."""
    assert main(["plan", "--model.preset=llama3-8b", "--training.seq_len=8192", "--training.micro_batch_size=16",
                 "--tokens", "1e9", "--gpu-options", "H100-SXM-80GB,A100-SXM-80GB", "--max-gpus", "8", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "global batch: 16 sequences (derived: micro_batch_size 16 x 1 data-parallel rank)" in captured.err
    assert result["global_batch"]["global_batch_size"] == 16 and result["global_batch"]["derived"] is True
    fitted = [o["candidate"] for o in result["options"] if o["candidate"]]
    assert {o["num_gpus"] for o in result["options"] if o["candidate"]} >= {1, 8}
    for c in fitted:  # tokens per step = 16 sequences x 8192 tokens
        assert c["tokens_per_second"] * c["step_time_s"] == pytest.approx(16 * 8192, rel=1e-9)


def test_the_gpu_example_plans_within_its_own_fixed_fields(capsys: pytest.CaptureFixture) -> None:
    """examples/llama3-8b-8xh100.toml fixes dp_shard=8, ZeRO-3 and selective checkpointing: no tensor or
    context parallelism fits beside them (there was a crash here), the memory knobs it leaves open vary."""
    example = Path(__file__).parents[1] / "examples" / "llama3-8b-8xh100.toml"
    assert main(["plan", str(example), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert rows and all(r["settings"]["parallel.dp_shard"] == 8 and r["settings"]["parallel.zero_stage"] == 3
                        and r["settings"]["memory.activation_checkpointing"] == "selective" for r in rows)
    assert len({(r["settings"]["memory.offload"], r["settings"]["memory.chunked_loss"]) for r in rows}) == len(rows)


ADAFACTOR_4 = ("--model.preset=debug", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=4",
               "--training.seq_len=128", "--training.global_batch_size=8", "--optimizer.name=adafactor")


def test_adafactor_is_planned_on_whole_parameters_and_train_refuses_the_rest_before_any_group(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Adafactor needs whole parameters (Layout.untrainable_reason): the plan lists no ZeRO-1, FSDP2
    or tensor-parallel layout and counts what it left out for it; `train` of a ZeRO-1 layout, started
    as rank 0 of 2 (rank 1 never comes: a process group would wait for it), and of FSDP2 on one rank
    under CPU offload, fails with the named error before any folder or process group exists."""
    result = json.loads(plan(*ADAFACTOR_4, "--top", "10", "--json").stdout)
    listed = [c["settings"] for c in result["candidates"]]
    assert listed and all(s["parallel.zero_stage"] == 0 and s["parallel.tp"] == 1 and s["memory.offload"] == "none"
                          for s in listed), listed
    assert any(why.startswith("not trainable: optimizer.name") for why in result["search"]["rejected"])

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    rank_0_of_2 = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
    zero1 = run_overrides(tmp_path / "zero1", "--optimizer.name=adafactor", "--hardware.num_gpus=2",
                          "--parallel.zero_stage=1", "--training.global_batch_size=8")
    proc = subprocess.run([sys.executable, "-m", "trainfit", "train", *zero1], capture_output=True, text=True,
                          env=rank_0_of_2, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert ("error: optimizer.name='adafactor' with parallel.zero_stage=1 on 2 ranks: Adafactor's factored "
            "statistics span whole parameters, and ZeRO-1 shards its states by rows; set parallel.zero_stage=0, or "
            "use another optimizer") in proc.stderr
    assert not (tmp_path / "zero1").exists()

    import torch.distributed as dist

    offload = run_overrides(tmp_path / "offload", "--optimizer.name=adafactor", "--parallel.zero_stage=2",
                            "--memory.offload=optimizer")
    assert main(["train", *offload]) == 2
    assert "error: optimizer.name='adafactor' with memory.offload='optimizer': the parameters are sharded DTensors" \
        in capsys.readouterr().err
    assert not dist.is_initialized() and not (tmp_path / "offload").exists()
